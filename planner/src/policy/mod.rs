//! The per-op save/recompute policy: one marker session per model, checkpointed layer and
//! micro-batch, walked in execution order.
//!
//! An op that runs while an interval of a kept unit is open is kept, unless it can never be:
//! a mutable op (its cached output could be overwritten before backward reads it), a
//! collective (it re-runs unless `--collectives save`), a view (recomputed from its saved
//! base), or an op in a compiled region (fused kernels never reach the per-op policy, and
//! markers inside them never fire).
//!
//! Besides a decision and a reason for every forward node, the walk records [`Findings`]: what
//! each kept unit's intervals did (opened, kept, stayed inert and why, were unbalanced or
//! crossed another), from which the diagnostics are built.

mod markers;

use std::collections::{BTreeMap, BTreeSet};

use ir::{
    plan::{Collectives, Decision, Executor, LayerRef, RandomOps, Reason},
    Graph, IdVec, ModelId, Node, NodeId, Phase, UnitId, ValueId,
};

use crate::config::{PlanConfig, Resolved};
use markers::{MarkerIndex, Session};

/// The policy's verdict on one forward node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePolicy {
    pub decision: Decision,
    pub reason: Reason,
    /// The kept unit whose interval was open (the innermost), if any; set for kept ops and for
    /// ops a kept interval enclosed but could not keep.
    pub unit: Option<UnitId>,
}

/// A unit of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnitKey {
    pub model: ModelId,
    pub unit: UnitId,
}

/// Where a marker session ran: a layer of a model, and the micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Site {
    pub at: LayerRef,
    pub micro_batch: u32,
}

/// What one kept interval did between its begin and end in one session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Enclosed {
    pub kept: usize,
    /// Ops it enclosed but could not keep, by reason (compiled, collective, mutable, ...).
    pub not_kept: BTreeMap<Reason, usize>,
    /// Compiled regions whose ops it enclosed.
    pub compiled_regions: BTreeSet<String>,
}

impl Enclosed {
    pub fn absorb(&mut self, other: &Enclosed) {
        self.kept += other.kept;
        for (&reason, n) in &other.not_kept {
            *self.not_kept.entry(reason).or_default() += n;
        }
        self.compiled_regions
            .extend(other.compiled_regions.iter().cloned());
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Unbalance {
    EndWithoutBegin,
    BeginWithoutEnd,
    BeginWhileOpen,
}

/// A marker of a kept unit that did not pair up, where.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MarkerFault {
    pub layer: u32,
    pub micro_batch: u32,
    pub marker: String,
    pub kind: Unbalance,
}

/// Intervals of two kept units that cross in a layer: one opens inside the other and closes
/// after it (nested intervals do not cross).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Crossing {
    /// The unit whose interval was opened first.
    pub unit: UnitKey,
    pub other: UnitId,
    pub layer: u32,
}

/// An in-place op that writes the output of a kept op later in forward, and cannot replay
/// with it: it also writes a tensor that stays resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InplaceWrite {
    pub unit: UnitKey,
    /// The writer.
    pub node: NodeId,
    /// The kept output it writes.
    pub value: ValueId,
}

/// A kept op demoted to recompute because forward writes its output in place later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demotion {
    pub unit: UnitKey,
    pub node: NodeId,
    /// The first op that writes its output.
    pub writer: NodeId,
}

/// Raw facts from the sessions, aggregated into diagnostics later.
#[derive(Debug, Default)]
pub struct Findings {
    /// Per kept unit and layer: what its intervals enclosed while open.
    pub enclosed: BTreeMap<UnitKey, BTreeMap<u32, Enclosed>>,
    /// Kept units whose markers appear only inside compiled regions in a layer, with the regions.
    pub markers_in_compiled: BTreeMap<UnitKey, BTreeMap<u32, BTreeSet<String>>>,
    pub unbalanced: BTreeMap<UnitKey, BTreeSet<MarkerFault>>,
    pub crossings: BTreeSet<Crossing>,
    pub inplace_kept: Vec<InplaceWrite>,
    pub demoted: Vec<Demotion>,
    /// Checkpointed layers whose forward ops all run in one compiled region.
    pub layers_compiled_whole: BTreeMap<ModelId, BTreeMap<u32, String>>,
    /// Forward nodes whose replay can differ from forward (a `topk` with ties, routing counts),
    /// with the innermost declared unit whose markers enclose them by position, compiled
    /// markers included (what a hint can point at).
    pub nondeterministic: BTreeMap<NodeId, Option<UnitId>>,
}

/// Decisions for every forward node (backward nodes have none) and the findings.
#[derive(Debug)]
pub struct Policy {
    pub nodes: IdVec<NodeId, Option<NodePolicy>>,
    pub findings: Findings,
}

impl Policy {
    pub fn decision(&self, node: NodeId) -> Option<Decision> {
        self.nodes[node].map(|p| p.decision)
    }
}

/// Applies the policy to every forward node of `graph`.
pub fn apply(graph: &Graph, config: &PlanConfig, resolved: &Resolved) -> Policy {
    let mut nodes: IdVec<NodeId, Option<NodePolicy>> = IdVec::filled(graph.nodes().len(), None);
    let mut findings = Findings::default();
    let sessions = sessions(graph, resolved, &mut nodes);
    let indexes: IdVec<ModelId, MarkerIndex> = IdVec::from_vec(
        graph
            .models()
            .values()
            .map(|m| MarkerIndex::of(&m.units))
            .collect(),
    );
    let rules = Rules {
        config,
        chosen: &resolved.chosen_ops,
        eager_on_host: config.executor == Executor::Eager && traced_on_host(graph),
    };
    for (&site, members) in &sessions {
        let index = &indexes[site.at.model];
        let kept = resolved.kept_at(site.at);
        let mut session = Session::new(graph, index, kept, site, &mut findings);
        for &id in members {
            let node = graph.node(id);
            nodes[id] = Some(match node.marker() {
                Some(marker) => session.on_marker(node, marker),
                None => {
                    let open = session.enclosure(id, node);
                    let policy = rules.decide(id, node, open);
                    session.record(node, policy);
                    policy
                }
            });
        }
        session.finish();
    }
    settle_written_outputs(graph, &mut nodes, &mut findings);
    find_layers_compiled_whole(graph, resolved, &sessions, &mut findings);
    Policy { nodes, findings }
}

/// Kept ops whose output forward writes in place later (an in-place normalisation of router
/// weights, a fresh buffer filled slice by slice): a saved copy would hold the written value,
/// and an executor that re-runs the writers (eager recompute) would apply them twice. Such an
/// op is demoted to recompute and replays with its writers, when they can replay: each
/// tensor they write is made in their layer by a recomputed op. Otherwise the writer would
/// corrupt a resident tensor too, and the keep is rejected.
fn settle_written_outputs(
    graph: &Graph,
    nodes: &mut IdVec<NodeId, Option<NodePolicy>>,
    findings: &mut Findings,
) {
    let written: Vec<(NodeId, Vec<(NodeId, ValueId)>)> = nodes
        .iter()
        .filter(|(_, p)| p.is_some_and(|p| p.decision == Decision::Save))
        .filter_map(|(id, _)| {
            let writes = later_writes(graph, id);
            (!writes.is_empty()).then_some((id, writes))
        })
        .collect();
    let candidates: BTreeSet<NodeId> = written.iter().map(|(id, _)| *id).collect();
    for (id, writes) in written {
        let Some(policy) = nodes[id] else { continue };
        let unit = policy.unit.map(|unit| UnitKey {
            model: graph.node(id).model,
            unit,
        });
        let blocking = writes
            .iter()
            .find(|&&(w, _)| !writer_replays(graph, nodes, &candidates, w));
        match (blocking, unit) {
            (None, _) => {
                // A random op that can no longer be saved replays with its generator state.
                let reason = match policy.reason {
                    Reason::Random => Reason::RandomReplayed,
                    _ => Reason::WrittenInPlace,
                };
                nodes[id] = Some(recompute(reason, policy.unit));
                if let Some(unit) = unit {
                    findings.demoted.push(Demotion {
                        unit,
                        node: id,
                        writer: writes[0].0,
                    });
                }
            }
            (Some(&(writer, value)), Some(unit)) => findings.inplace_kept.push(InplaceWrite {
                unit,
                node: writer,
                value,
            }),
            // Kept on its own (a saved collective, a chosen op): recompute it instead.
            (Some(_), None) => nodes[id] = Some(recompute(Reason::WrittenInPlace, None)),
        }
    }
}

/// The forward ops of `kept`'s layer that write its outputs in place after it, with the
/// output each writes.
fn later_writes(graph: &Graph, kept: NodeId) -> Vec<(NodeId, ValueId)> {
    let k = graph.node(kept);
    let mut writes = Vec::new();
    for &v in &k.outputs {
        for &w in graph.storage_writers(v) {
            let n = graph.node(w);
            if w > kept && n.phase == Phase::Forward && (n.model, n.layer) == (k.model, k.layer) {
                writes.push((w, v));
            }
        }
    }
    writes.sort_unstable();
    writes.dedup_by_key(|(w, _)| *w);
    writes
}

/// Whether `writer` can replay with the kept ops it writes: every tensor it writes is made in
/// its layer by a recomputed op (or by one of the kept ops being demoted).
fn writer_replays(
    graph: &Graph,
    nodes: &IdVec<NodeId, Option<NodePolicy>>,
    demoted: &BTreeSet<NodeId>,
    writer: NodeId,
) -> bool {
    let w = graph.node(writer);
    w.effects.mutates.iter().all(|&p| {
        let root = graph.storage_root(w.inputs[p]);
        graph.producer(root).is_some_and(|producer| {
            let made = graph.node(producer);
            let recomputed = nodes[producer].is_some_and(|p| p.decision == Decision::Recompute);
            (made.model, made.layer) == (w.model, w.layer)
                && made.phase == Phase::Forward
                && (recomputed || demoted.contains(&producer))
        })
    })
}

/// The ops one interval encloses in one layer run, by marker position (markers inside compiled
/// regions included, as written): the marker walk the policy runs, listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntervalContents<'g> {
    pub site: Site,
    pub begin: &'g str,
    pub end: &'g str,
    pub nodes: Vec<NodeId>,
}

/// What every declared interval of every layer run of `graph` encloses: sorted by site, then
/// begin marker; the nodes of each in execution order.
pub fn interval_contents(graph: &Graph) -> Vec<IntervalContents<'_>> {
    let config = PlanConfig {
        keep: ir::plan::Keep::All,
        ..PlanConfig::default()
    };
    // Keeping every declared unit names no unknown unit: resolving cannot fail.
    let Ok(resolved) = crate::config::resolve(graph, &config) else {
        return Vec::new();
    };
    let mut nodes: IdVec<NodeId, Option<NodePolicy>> = IdVec::filled(graph.nodes().len(), None);
    let mut findings = Findings::default();
    let mut contents: BTreeMap<(Site, &str, &str), Vec<NodeId>> = BTreeMap::new();
    for (site, members) in sessions(graph, &resolved, &mut nodes) {
        let index = MarkerIndex::of(&graph.model(site.at.model).units);
        let kept = resolved.kept_at(site.at);
        let mut session = Session::new(graph, &index, kept, site, &mut findings);
        session.list_members();
        for id in members {
            let node = graph.node(id);
            match node.marker() {
                Some(marker) => {
                    session.on_marker(node, marker);
                }
                None => {
                    session.enclosure(id, node);
                }
            }
        }
        for (begin, end, node) in session.listed() {
            let enclosed = contents.entry((site, begin, end)).or_default();
            enclosed.extend(node);
        }
    }
    contents
        .into_iter()
        .map(|((site, begin, end), nodes)| IntervalContents {
            site,
            begin,
            end,
            nodes,
        })
        .collect()
}

/// The forward nodes of each checkpointed site, in execution order; every other forward node
/// is decided here (not checkpointed). A site's nodes come in runs (a layer's forward), so a
/// run is gathered before it is filed under its site, one map lookup per run.
fn sessions(
    graph: &Graph,
    resolved: &Resolved,
    nodes: &mut IdVec<NodeId, Option<NodePolicy>>,
) -> BTreeMap<Site, Vec<NodeId>> {
    let mut sessions: BTreeMap<Site, Vec<NodeId>> = BTreeMap::new();
    let mut file = |(site, run): (Site, Vec<NodeId>)| {
        sessions.entry(site).or_default().extend(run);
    };
    let mut run: Option<(Site, Vec<NodeId>)> = None;
    for (id, node) in graph.nodes().iter() {
        if node.phase != Phase::Forward {
            continue;
        }
        match node.layer {
            Some(layer) if resolved.is_checkpointed(node.model, Some(layer)) => {
                let site = Site {
                    at: LayerRef {
                        model: node.model,
                        layer,
                    },
                    micro_batch: node.micro_batch,
                };
                match &mut run {
                    Some((current, members)) if *current == site => members.push(id),
                    _ => {
                        if let Some(done) = run.replace((site, vec![id])) {
                            file(done);
                        }
                    }
                }
            }
            Some(_) => nodes[id] = Some(not_checkpointed(Reason::LayerNotCheckpointed)),
            None => nodes[id] = Some(not_checkpointed(Reason::OutsideLayers)),
        }
    }
    if let Some(done) = run {
        file(done);
    }
    sessions
}

fn not_checkpointed(reason: Reason) -> NodePolicy {
    NodePolicy {
        decision: Decision::NoCheckpoint,
        reason,
        unit: None,
    }
}

fn recompute(reason: Reason, unit: Option<UnitId>) -> NodePolicy {
    NodePolicy {
        decision: Decision::Recompute,
        reason,
        unit,
    }
}

/// What decides an op, besides the open intervals.
struct Rules<'a> {
    config: &'a PlanConfig,
    /// Ops the budget solver keeps one by one.
    chosen: &'a BTreeSet<NodeId>,
    /// The plan is for eager execution of a graph traced on the CPU, where some random ops
    /// run as other ops than the trace shows ([`EAGER_HOST_UNCACHED_RANDOM`]).
    eager_on_host: bool,
}

/// Random ops that eager PyTorch on the CPU runs as other, in-place ops, which a selective
/// checkpoint cannot cache: CPU dropout fills a mask with `bernoulli_` where the trace has
/// `native_dropout` (on a GPU, eager dispatches the fused `native_dropout` itself). Under eager
/// checkpointing they re-run in the recompute, with the generator state forward saw restored.
pub(crate) const EAGER_HOST_UNCACHED_RANDOM: &[&str] = &["aten.native_dropout"];

/// Whether the graph was traced on the CPU, as its factory ops say (`device` attributes: only
/// the CPU named). A graph naming another device, or none, is not.
pub(crate) fn traced_on_host(graph: &Graph) -> bool {
    let mut devices = graph
        .nodes()
        .values()
        .filter_map(|n| match n.attribute("device") {
            Some(ir::AttrValue::Str(d)) => Some(d.as_str()),
            _ => None,
        })
        .peekable();
    devices.peek().is_some() && devices.all(|d| d == "cpu" || d.starts_with("cpu:"))
}

impl Rules<'_> {
    /// The decision for a non-marker op in a checkpointed layer, `unit` being the innermost
    /// open kept unit.
    fn decide(&self, id: NodeId, node: &Node, unit: Option<UnitId>) -> NodePolicy {
        if let Some(policy) = self.random(node, unit) {
            return policy;
        }
        let chosen = self.chosen.contains(&id);
        if unit.is_none() && !chosen && !self.saves_as_collective(node) {
            // A compiled op is out of the policy's reach, interval or not.
            let reason = match node.compiled_region {
                Some(_) => Reason::Compiled,
                None => Reason::OutsideKeptInterval,
            };
            return recompute(reason, None);
        }
        let mut policy = self.classify(node, unit);
        if chosen && unit.is_none() && policy.reason == Reason::KeptInterval {
            policy.reason = Reason::ChosenOp;
        }
        policy
    }

    /// The decision for an op while kept `unit` is open, or outside any kept interval for a
    /// collective that `--collectives save` keeps.
    fn classify(&self, node: &Node, unit: Option<UnitId>) -> NodePolicy {
        let effects = &node.effects;
        if node.compiled_region.is_some() {
            recompute(Reason::Compiled, unit)
        } else if effects.is_mutable() {
            recompute(Reason::Mutable, unit)
        } else if self.saves_as_collective(node) {
            NodePolicy {
                decision: Decision::Save,
                reason: Reason::SavedCollective,
                unit,
            }
        } else if is_sync(node) {
            recompute(Reason::Collective, unit)
        } else if effects.view_of.is_some() {
            recompute(Reason::View, unit)
        } else {
            NodePolicy {
                decision: Decision::Save,
                reason: Reason::KeptInterval,
                unit,
            }
        }
    }

    /// A random op never replays with other random numbers than forward drew: saved, or
    /// replayed with the forward generator state, as `--random-ops` says. A compiled one is out
    /// of the per-op policy's reach and replays (its region restores the state, or not), and so
    /// does one eager on the CPU runs as ops it cannot cache.
    fn random(&self, node: &Node, unit: Option<UnitId>) -> Option<NodePolicy> {
        if !node.draws_random() || node.effects.is_mutable() {
            return None;
        }
        let uncached = self.eager_on_host && EAGER_HOST_UNCACHED_RANDOM.contains(&node.packet());
        if node.compiled_region.is_some() || self.config.random_ops == RandomOps::Replay || uncached
        {
            return Some(recompute(Reason::RandomReplayed, unit));
        }
        Some(NodePolicy {
            decision: Decision::Save,
            reason: Reason::Random,
            unit,
        })
    }

    /// With `--collectives save`, eager functional collectives and device-to-host syncs are
    /// saved in every checkpointed layer, kept interval or not; mutating ones never.
    /// `wait_tensor` returns the collective's own buffer (an alias): saving the collective
    /// covers it, and its replay is a no-op.
    fn saves_as_collective(&self, node: &Node) -> bool {
        self.config.collectives == Collectives::Save
            && is_sync(node)
            && node.compiled_region.is_none()
            && node.effects.view_of.is_none()
            && !node.effects.is_mutable()
    }
}

/// A collective, or a device-to-host copy that synchronises like one.
fn is_sync(node: &Node) -> bool {
    node.effects.collective.is_some() || node.is_device_to_host_copy()
}

/// Checkpointed layers of models with kept units whose forward ops (markers aside) all run in
/// one compiled region: nothing in them is addressable.
fn find_layers_compiled_whole(
    graph: &Graph,
    resolved: &Resolved,
    sessions: &BTreeMap<Site, Vec<NodeId>>,
    findings: &mut Findings,
) {
    let mut regions: BTreeMap<LayerRef, Option<BTreeSet<&str>>> = BTreeMap::new();
    for (site, members) in sessions {
        if resolved.kept_at(site.at).is_empty() {
            continue;
        }
        let seen = regions.entry(site.at).or_insert(Some(BTreeSet::new()));
        for &id in members {
            let node = graph.node(id);
            if node.marker().is_some() {
                continue;
            }
            match (&node.compiled_region, seen.as_mut()) {
                (Some(region), Some(set)) => {
                    set.insert(region.as_str());
                }
                (None, _) => *seen = None,
                (Some(_), None) => {}
            }
        }
    }
    for (at, seen) in regions {
        if let Some(set) = seen.filter(|s| s.len() == 1) {
            let region = set.into_iter().next().unwrap_or_default().to_owned();
            findings
                .layers_compiled_whole
                .entry(at.model)
                .or_default()
                .insert(at.layer, region);
        }
    }
}
