//! The per-op save/recompute policy (R4–R6): one marker session per model, checkpointed layer
//! and micro-batch, walked in execution order.
//!
//! Besides a decision and a reason for every forward node, the walk records [`Findings`]: what
//! each kept unit's intervals did (opened, kept, stayed inert and why, were unbalanced or
//! overlapped), from which the diagnostics are built.

use std::collections::{BTreeMap, BTreeSet};

use ir::{Graph, IdVec, ModelId, Node, NodeId, Phase, ValueId};

use crate::config::{Collectives, PlanConfig, Resolved};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Decision {
    /// The output is kept resident for backward.
    Save,
    /// The op re-runs in replay when backward needs its output.
    Recompute,
    /// Not in a checkpointed layer: autograd saves what backward needs, nothing re-runs.
    NoCheckpoint,
}

impl Decision {
    pub fn name(self) -> &'static str {
        match self {
            Decision::Save => "save",
            Decision::Recompute => "recompute",
            Decision::NoCheckpoint => "no-checkpoint",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// Ran while a kept interval was open (R4).
    KeptInterval,
    /// Ran while no kept interval was open.
    OutsideKeptInterval,
    /// Mutable schema: never kept (R5).
    Mutable,
    /// A collective (or a device-to-host sync): re-runs in replay (R5, default).
    Collective,
    /// A functional collective or device-to-host sync saved by `--collectives save` (R5).
    SavedCollective,
    /// Runs inside a compiled region: never reaches the per-op policy (R6).
    Compiled,
    /// A `checkpoint_record` point marker (an identity): recomputed, never kept.
    Marker,
    /// A view: recomputed from its saved base, never saved on its own (R8).
    View,
    /// Kept on its own by the budget solver (`--granularity op`).
    ChosenOp,
    /// Its layer is not selected by `--recompute-ratio` (R3).
    LayerNotCheckpointed,
    /// Outside any decoder layer (embedding, head, loss).
    OutsideLayers,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::KeptInterval => "kept-interval",
            Reason::OutsideKeptInterval => "outside-kept-interval",
            Reason::Mutable => "mutable",
            Reason::Collective => "collective",
            Reason::SavedCollective => "saved-collective",
            Reason::Compiled => "compiled",
            Reason::Marker => "marker",
            Reason::View => "view",
            Reason::ChosenOp => "chosen-op",
            Reason::LayerNotCheckpointed => "layer-not-checkpointed",
            Reason::OutsideLayers => "outside-layers",
        }
    }
}

/// The policy's verdict on one forward node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePolicy {
    pub decision: Decision,
    pub reason: Reason,
    /// The kept unit (index into the model's `units`) whose interval was open, if any; set for
    /// kept ops and for ops a kept interval enclosed but could not keep.
    pub unit: Option<usize>,
}

/// A unit of a model, by index into `Model::units`.
pub type UnitKey = (ModelId, usize);

/// Where a marker session ran: model, layer, micro-batch.
pub type Site = (ModelId, u32, u32);

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
    fn absorb(&mut self, other: Enclosed) {
        self.kept += other.kept;
        for (reason, n) in other.not_kept {
            *self.not_kept.entry(reason).or_default() += n;
        }
        self.compiled_regions.extend(other.compiled_regions);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Unbalance {
    EndWithoutBegin,
    BeginWithoutEnd,
    BeginWhileOpen,
}

/// Raw facts from the sessions, aggregated into diagnostics later.
#[derive(Debug, Default)]
pub struct Findings {
    /// Per kept unit and layer: what its intervals enclosed while open.
    pub enclosed: BTreeMap<UnitKey, BTreeMap<u32, Enclosed>>,
    /// Kept units whose markers appear only inside compiled regions in a layer, with the regions.
    pub markers_in_compiled: BTreeMap<UnitKey, BTreeMap<u32, BTreeSet<String>>>,
    pub unbalanced: BTreeMap<UnitKey, BTreeSet<(u32, u32, String, Unbalance)>>,
    /// Two kept units' intervals open at once: (unit, other unit, layer).
    pub overlaps: BTreeSet<(UnitKey, usize, u32)>,
    /// In-place ops in a kept interval writing a kept tensor: (unit, node, written value).
    pub inplace_kept: Vec<(UnitKey, NodeId, ValueId)>,
    /// Checkpointed layers whose forward ops all run in one compiled region.
    pub layers_compiled_whole: BTreeMap<ModelId, BTreeMap<u32, String>>,
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
    let mut sessions: BTreeMap<Site, Vec<NodeId>> = BTreeMap::new();
    for (id, node) in graph.nodes().iter() {
        if node.phase != Phase::Forward {
            continue;
        }
        match node.layer {
            Some(layer) if resolved.is_checkpointed(node.model, Some(layer)) => sessions
                .entry((node.model, layer, node.micro_batch))
                .or_default()
                .push(id),
            Some(_) => nodes[id] = Some(not_checkpointed(Reason::LayerNotCheckpointed)),
            None => nodes[id] = Some(not_checkpointed(Reason::OutsideLayers)),
        }
    }
    let mut kept_alias: IdVec<ValueId, bool> = IdVec::filled(graph.values().len(), false);
    for (&site, members) in &sessions {
        let mut session = Session::new(graph, config, resolved, site, &mut findings);
        for &id in members {
            nodes[id] = Some(session.step(id, &mut kept_alias));
        }
        session.finish();
    }
    find_layers_compiled_whole(graph, resolved, &sessions, &mut findings);
    Policy { nodes, findings }
}

fn not_checkpointed(reason: Reason) -> NodePolicy {
    NodePolicy {
        decision: Decision::NoCheckpoint,
        reason,
        unit: None,
    }
}

/// One declared interval of a kept unit.
struct Interval<'g> {
    unit: usize,
    begin: &'g str,
    end: &'g str,
}

/// The marker session of one site: which kept intervals are open, and what each encloses.
struct Session<'a, 'g> {
    graph: &'g Graph,
    config: &'a PlanConfig,
    site: Site,
    intervals: Vec<Interval<'g>>,
    /// Per interval: `Some(what it enclosed so far)` while open.
    open: Vec<Option<Enclosed>>,
    /// Per kept unit: whether one of its markers fired in eager in this session, and the
    /// compiled regions its markers were found in.
    fired: BTreeSet<usize>,
    compiled_markers: BTreeMap<usize, BTreeSet<String>>,
    /// Ops the budget solver keeps one by one.
    chosen: &'a BTreeSet<NodeId>,
    findings: &'a mut Findings,
}

impl<'a, 'g> Session<'a, 'g> {
    fn new(
        graph: &'g Graph,
        config: &'a PlanConfig,
        resolved: &'a Resolved,
        site: Site,
        findings: &'a mut Findings,
    ) -> Self {
        let model = graph.model(site.0);
        let intervals: Vec<Interval<'g>> = resolved
            .kept_at(site.0, site.1)
            .iter()
            .flat_map(|&unit| {
                model.units[unit].intervals.iter().map(move |i| Interval {
                    unit,
                    begin: i.begin.as_str(),
                    end: i.end.as_str(),
                })
            })
            .collect();
        let open = intervals.iter().map(|_| None).collect();
        Session {
            graph,
            config,
            site,
            intervals,
            open,
            fired: BTreeSet::new(),
            compiled_markers: BTreeMap::new(),
            chosen: &resolved.chosen_ops,
            findings,
        }
    }

    fn step(&mut self, id: NodeId, kept_alias: &mut IdVec<ValueId, bool>) -> NodePolicy {
        let node = self.graph.node(id);
        if let Some(marker) = &node.marker {
            self.on_marker(node, marker);
            let reason = if node.compiled_region.is_some() {
                Reason::Compiled
            } else {
                Reason::Marker
            };
            return recompute(reason, None);
        }
        let unit = self.open_unit();
        let chosen = self.chosen.contains(&id);
        if unit.is_none() && !chosen && !self.saves_as_collective(node) {
            // A compiled op is out of the policy's reach, interval or not (R6).
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
        if policy.decision == Decision::Save {
            for &v in &node.outputs {
                kept_alias[v] = true;
            }
        } else if policy.reason == Reason::View {
            // A view of a kept tensor aliases it: writing through it corrupts the cache too.
            let base = node.effects.view_of.map(|p| node.inputs[p]);
            if base.is_some_and(|b| kept_alias[b]) {
                for &v in &node.outputs {
                    kept_alias[v] = true;
                }
            }
        } else if policy.reason == Reason::Mutable {
            for &p in &node.effects.mutates {
                let written = node.inputs[p];
                if let Some(unit) = unit.filter(|_| kept_alias[written]) {
                    self.findings
                        .inplace_kept
                        .push(((self.site.0, unit), id, written));
                }
            }
        }
        self.record(node, policy);
        policy
    }

    /// The decision for an op while kept `unit` (the first open kept unit) is open, or outside
    /// any kept interval for a collective that `--collectives save` keeps.
    fn classify(&self, node: &Node, unit: Option<usize>) -> NodePolicy {
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

    /// R5: with `--collectives save`, eager functional collectives and device-to-host syncs
    /// are saved in every checkpointed layer, kept interval or not (the second seed's op-list
    /// policy); mutating ones never. `wait_tensor` returns the collective's own buffer (an
    /// alias): saving the collective covers it, and its replay is a no-op, as the second seed
    /// settled.
    fn saves_as_collective(&self, node: &Node) -> bool {
        self.config.collectives == Collectives::Save
            && is_sync(node)
            && node.compiled_region.is_none()
            && node.effects.view_of.is_none()
            && !node.effects.is_mutable()
    }

    /// Counts what the open intervals enclosed.
    fn record(&mut self, node: &Node, policy: NodePolicy) {
        for enclosed in self.open.iter_mut().flatten() {
            if policy.decision == Decision::Save {
                enclosed.kept += 1;
            } else {
                *enclosed.not_kept.entry(policy.reason).or_default() += 1;
                if let Some(region) = &node.compiled_region {
                    enclosed.compiled_regions.insert(region.to_string());
                }
            }
        }
    }

    /// The lowest-numbered kept unit with an open interval.
    fn open_unit(&self) -> Option<usize> {
        self.open
            .iter()
            .zip(&self.intervals)
            .filter(|(open, _)| open.is_some())
            .map(|(_, i)| i.unit)
            .min()
    }

    fn on_marker(&mut self, node: &Node, marker: &str) {
        if let Some(region) = &node.compiled_region {
            // R6: a marker inside a compiled region never fires.
            for i in self
                .intervals
                .iter()
                .filter(|i| i.begin == marker || i.end == marker)
            {
                self.compiled_markers
                    .entry(i.unit)
                    .or_default()
                    .insert(region.to_string());
            }
            return;
        }
        // Ends first, so that `[a, b)` followed by `[b, c)` hands over cleanly.
        for i in 0..self.intervals.len() {
            if self.intervals[i].end == marker {
                self.fired.insert(self.intervals[i].unit);
                match self.open[i].take() {
                    Some(enclosed) => self.close(i, enclosed),
                    None => self.unbalanced(i, marker, Unbalance::EndWithoutBegin),
                }
            }
        }
        for i in 0..self.intervals.len() {
            if self.intervals[i].begin == marker {
                self.fired.insert(self.intervals[i].unit);
                if self.open[i].is_some() {
                    self.unbalanced(i, marker, Unbalance::BeginWhileOpen);
                    continue;
                }
                self.note_overlaps(i);
                self.open[i] = Some(Enclosed::default());
            }
        }
    }

    fn note_overlaps(&mut self, opening: usize) {
        let unit = self.intervals[opening].unit;
        let (model, layer, _) = self.site;
        for (j, interval) in self.intervals.iter().enumerate() {
            if self.open[j].is_some() && interval.unit != unit {
                let (a, b) = (unit.min(interval.unit), unit.max(interval.unit));
                self.findings.overlaps.insert(((model, a), b, layer));
            }
        }
    }

    fn unbalanced(&mut self, interval: usize, marker: &str, kind: Unbalance) {
        let (model, layer, micro_batch) = self.site;
        self.findings
            .unbalanced
            .entry((model, self.intervals[interval].unit))
            .or_default()
            .insert((layer, micro_batch, marker.to_owned(), kind));
    }

    fn close(&mut self, interval: usize, enclosed: Enclosed) {
        let (model, layer, _) = self.site;
        self.findings
            .enclosed
            .entry((model, self.intervals[interval].unit))
            .or_default()
            .entry(layer)
            .or_default()
            .absorb(enclosed);
    }

    /// R4: a begin without an end closes at the layer's end; also records markers that only
    /// appeared inside compiled regions.
    fn finish(mut self) {
        for i in 0..self.intervals.len() {
            if let Some(enclosed) = self.open[i].take() {
                let begin = self.intervals[i].begin;
                self.unbalanced(i, begin, Unbalance::BeginWithoutEnd);
                self.close(i, enclosed);
            }
        }
        let (model, layer, _) = self.site;
        for (unit, regions) in std::mem::take(&mut self.compiled_markers) {
            if !self.fired.contains(&unit) {
                self.findings
                    .markers_in_compiled
                    .entry((model, unit))
                    .or_default()
                    .entry(layer)
                    .or_default()
                    .extend(regions);
            }
        }
    }
}

/// A collective, or a device-to-host copy that synchronises like one.
fn is_sync(node: &Node) -> bool {
    node.effects.collective.is_some() || node.is_device_to_host_copy()
}

fn recompute(reason: Reason, unit: Option<usize>) -> NodePolicy {
    NodePolicy {
        decision: Decision::Recompute,
        reason,
        unit,
    }
}

/// Checkpointed layers of models with kept units whose forward ops (markers aside) all run in
/// one compiled region: nothing in them is addressable (the first seed's non-EP config).
fn find_layers_compiled_whole(
    graph: &Graph,
    resolved: &Resolved,
    sessions: &BTreeMap<Site, Vec<NodeId>>,
    findings: &mut Findings,
) {
    let mut regions: BTreeMap<(ModelId, u32), Option<BTreeSet<&str>>> = BTreeMap::new();
    for (&(model, layer, _), members) in sessions {
        if resolved.kept_at(model, layer).is_empty() {
            continue;
        }
        let seen = regions
            .entry((model, layer))
            .or_insert(Some(BTreeSet::new()));
        for &id in members {
            let node = graph.node(id);
            if node.marker.is_some() {
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
    for ((model, layer), seen) in regions {
        if let Some(set) = seen.filter(|s| s.len() == 1) {
            let region = set.into_iter().next().unwrap_or_default().to_owned();
            findings
                .layers_compiled_whole
                .entry(model)
                .or_default()
                .insert(layer, region);
        }
    }
}
