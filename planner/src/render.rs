//! The human output formats of a [`Plan`]: text and DOT. (JSON and protobuf are the plan's own
//! formats, in `ir::plan`.) Every one is deterministic: same plan, same bytes.

use std::{collections::BTreeMap, fmt::Write as _};

use rustc_hash::FxHashMap as HashMap;

use ir::{
    plan::{
        Decision, DeviceTotal, Diagnostic, Keep, LayerRef, NodeDecision, Plan, SavedValue, Training,
    },
    EntityId, Graph, NodeId, Phase,
};

use crate::units::{format_bytes, format_seconds, format_size};

/// The human form: config, per-unit kept ops and bytes, saved set, replay, diagnostics.
pub fn text(plan: &Plan, graph: &Graph) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "plan for {}  (fingerprint {}, planner {})",
        plan.graph.name, plan.graph.fingerprint, plan.planner_version
    );
    let keep = match &plan.config.keep {
        _ if plan.config.budget_bytes.is_some() => "per layer, for the budget".to_owned(),
        Keep::Nothing => "nothing (whole-layer recompute)".to_owned(),
        Keep::All => "ALL".to_owned(),
        Keep::Units(units) => units.join(", "),
    };
    let _ = writeln!(
        w,
        "config: keep {keep}; recompute-ratio {}; collectives {}",
        plan.config.recompute_ratio, plan.config.collectives
    );
    text_budget(w, plan, graph);
    text_decisions(w, &plan.nodes);
    text_units(w, plan, graph);
    if plan.joint {
        text_saved(w, &plan.saved, plan.memory.saved_bytes);
        text_replay(w, plan, graph);
        text_memory(w, plan, graph);
    } else {
        let _ = writeln!(
            w,
            "partition: needs a joint forward+backward graph; this one has no backward nodes"
        );
    }
    text_diagnostics(w, &plan.diagnostics);
    out
}

/// The per-layer choices (the budget solver's, or `--choices`), runs of equal choices folded:
/// units kept, and units offloaded.
fn text_budget(w: &mut String, plan: &Plan, graph: &Graph) {
    if let Some(budget) = plan.config.budget_bytes {
        let _ = writeln!(
            w,
            "budget {}: keeps {}",
            format_bytes(budget),
            crate::pareto::describe(&plan.config.layer_keep, graph)
        );
    }
    if plan.config.budget_bytes.is_none() && !plan.config.layer_keep.is_empty() {
        let _ = writeln!(
            w,
            "choices: keeps {}",
            crate::pareto::describe(&plan.config.layer_keep, graph)
        );
    }
    if !plan.config.layer_offload.is_empty() {
        let _ = writeln!(
            w,
            "to host memory: {}",
            crate::pareto::describe_offload(&plan.config.layer_offload, graph)
        );
    }
}

fn text_decisions(w: &mut String, nodes: &[NodeDecision]) {
    let counts = sorted_counts(nodes.iter().map(|n| (n.decision.name(), n.reason.name())));
    let _ = writeln!(w, "forward nodes: {}", nodes.len());
    for ((decision, reason), n) in counts {
        let _ = writeln!(w, "  {decision:<13} {reason:<22} {n}");
    }
}

fn text_units(w: &mut String, plan: &Plan, graph: &Graph) {
    if plan.units.is_empty() {
        let _ = writeln!(w, "kept units: none");
        return;
    }
    let _ = writeln!(w, "kept units:");
    let mut kept: HashMap<(ir::ModelId, u32, ir::UnitId), Vec<&NodeDecision>> = HashMap::default();
    for n in &plan.nodes {
        if let (Some(layer), Some(unit)) = (n.layer, n.unit) {
            kept.entry((n.model, layer, unit)).or_default().push(n);
        }
    }
    for u in &plan.units {
        let model = graph.model(u.model);
        let _ = writeln!(
            w,
            "  {} / {}: {} ops kept, {} saved, {} of replay avoided",
            model.name,
            model.units[u.unit].name,
            u.kept_ops,
            format_bytes(u.saved_bytes),
            format_seconds(u.replay_time_avoided_s)
        );
        for l in &u.layers {
            let nodes = kept.get(&(u.model, l.layer, u.unit));
            let ops = op_histogram(graph, nodes.into_iter().flatten().copied());
            let _ = writeln!(
                w,
                "    layer {}: {} ops, {}: {ops}",
                l.layer,
                l.kept_ops,
                format_bytes(l.saved_bytes)
            );
        }
    }
}

/// How often each key occurs, in key order (counted in a hash map: a million nodes).
pub(crate) fn sorted_counts<K: Ord + std::hash::Hash>(
    keys: impl Iterator<Item = K>,
) -> Vec<(K, usize)> {
    let mut counts: HashMap<K, usize> = HashMap::default();
    for key in keys {
        *counts.entry(key).or_default() += 1;
    }
    let mut counts: Vec<(K, usize)> = counts.into_iter().collect();
    counts.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    counts
}

/// `aten.mm.default ×3, aten.silu.default` in name order.
fn op_histogram<'a>(graph: &'a Graph, nodes: impl Iterator<Item = &'a NodeDecision>) -> String {
    histogram(sorted_counts(nodes.map(|n| graph.node(n.node).op.as_str())))
}

/// `name ×count` items, a count of 1 left out.
fn histogram(counts: Vec<(&str, usize)>) -> String {
    counts
        .into_iter()
        .map(|(op, n)| match n {
            1 => op.to_owned(),
            n => format!("{op} ×{n}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The saved set by kind; views and in-place results of other tensors hold no storage of
/// their own and are counted apart.
fn text_saved(w: &mut String, saved: &[SavedValue], activation_bytes: u64) {
    let mut by_kind: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    let mut aliases = 0;
    for s in saved {
        if s.alias_of.is_some() {
            aliases += 1;
            continue;
        }
        let entry = by_kind.entry(s.kind.name()).or_default();
        entry.0 += 1;
        entry.1 = entry.1.saturating_add(s.bytes);
    }
    let _ = writeln!(
        w,
        "saved for backward: {} values, {} of activations",
        saved.len(),
        format_bytes(activation_bytes)
    );
    for (kind, (n, bytes)) in by_kind {
        let _ = writeln!(w, "  {kind:<17} {n:>5} values  {}", format_bytes(bytes));
    }
    if aliases > 0 {
        let _ = writeln!(
            w,
            "  {:<17} {aliases:>5} values  (views of the above or of inputs: no storage)",
            "aliases"
        );
    }
}

fn text_replay(w: &mut String, plan: &Plan, graph: &Graph) {
    if plan.replay.is_empty() {
        let _ = writeln!(w, "replay: nothing re-runs in backward");
        return;
    }
    // Per layer, in the order the layers first replay: its ops, steps and first step.
    let mut layers: Vec<(LayerRef, usize, usize, NodeId)> = Vec::new();
    for r in &plan.replay {
        match layers.iter_mut().find(|l| l.0 == r.at) {
            Some(layer) => (layer.1, layer.2) = (layer.1 + r.nodes.len(), layer.2 + 1),
            None => layers.push((r.at, r.nodes.len(), 1, r.before)),
        }
    }
    let total: usize = plan.replay.iter().map(|r| r.nodes.len()).sum();
    let _ = writeln!(
        w,
        "replay: {total} ops in {} layers, {} steps (each op just before the first backward node that needs it)",
        layers.len(),
        plan.replay.len()
    );
    for (at, ops, steps, first) in layers {
        let steps = if steps == 1 {
            String::new()
        } else {
            format!(" in {steps} steps, the first")
        };
        let _ = writeln!(
            w,
            "  {} layer {}: {ops} ops{steps} before `{}`",
            graph.model(at.model).name,
            at.layer,
            graph.node(first).name
        );
    }
    let replayed = plan
        .replay
        .iter()
        .flat_map(|r| r.nodes.iter())
        .map(|&n| graph.node(n).op.as_str());
    let _ = writeln!(w, "  replayed ops: {}", histogram(sorted_counts(replayed)));
}

fn text_memory(w: &mut String, plan: &Plan, graph: &Graph) {
    let m = &plan.memory;
    let c = &plan.cost;
    let peak = |p: Option<u64>| p.map_or_else(|| "-".to_owned(), format_bytes);
    let at = match m.peak {
        Some(p) => format!(" (in {}, at `{}`)", p.stage, graph.node(p.node).name),
        None => String::new(),
    };
    let _ = writeln!(
        w,
        "memory (parameters apart: {}):",
        format_bytes(m.parameter_bytes)
    );
    let _ = writeln!(w, "  peak, this plan            {}{at}", peak(m.peak_bytes));
    let _ = writeln!(
        w,
        "  peak, no checkpointing     {}",
        peak(m.no_checkpoint_peak_bytes)
    );
    let _ = writeln!(
        w,
        "  peak, whole-layer recompute {}",
        peak(m.full_recompute_peak_bytes)
    );
    text_offload(w, plan);
    if let Some(device) = &m.device {
        text_device(w, device, &plan.config.training);
    }
    let _ = writeln!(
        w,
        "cost ({}): replay {} FLOPs, {} moved, {} re-communicated, {} (whole-layer recompute: {})",
        c.hw,
        c.replay_flops,
        format_bytes(c.replay_bytes),
        format_bytes(c.replay_comm_bytes),
        format_seconds(c.replay_time_s),
        format_seconds(c.full_recompute_replay_time_s)
    );
    let syncs = match c.replay_host_syncs {
        0 => String::new(),
        n => format!("; replay re-runs {n} host synchronisation(s)"),
    };
    let exposed = if plan.memory.offloaded_bytes > 0 {
        format!(
            " + exposed transfer {}",
            format_seconds(c.exposed_transfer_time_s)
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        w,
        "step time ({}): {} = forward {} + replay {} + backward {}{exposed}{syncs}",
        c.hw,
        format_seconds(c.step_time_s),
        format_seconds(c.forward_time_s),
        format_seconds(c.replay_time_s),
        format_seconds(c.backward_time_s)
    );
}

/// What the plan offloads, when it offloads anything: the values, their bytes, the most the
/// host holds at once, and the copies' time (in all, and the part compute does not hide).
fn text_offload(w: &mut String, plan: &Plan) {
    let m = &plan.memory;
    if m.offloaded_bytes == 0 {
        return;
    }
    let values = plan.saved.iter().filter(|s| s.offloaded).count();
    let _ = writeln!(
        w,
        "  offloaded to host          {values} values, {} (host peak {} of {}); transfer {}, {} exposed (prefetch {} steps)",
        format_bytes(m.offloaded_bytes),
        format_bytes(m.host_peak_bytes),
        format_size(m.host_memory_bytes),
        format_seconds(plan.cost.transfer_time_s),
        format_seconds(plan.cost.exposed_transfer_time_s),
        plan.config.offload.prefetch,
    );
}

/// The whole training state on one device, its parts, and whether it fits.
fn text_device(w: &mut String, d: &DeviceTotal, training: &Training) {
    let master = if training.master_weights {
        ", fp32 master weights"
    } else {
        ""
    };
    let _ = writeln!(
        w,
        "device total (fsdp {}, {} state in {}{master}): {}, in {}",
        training.fsdp,
        training.optimizer,
        training.state_dtype,
        format_bytes(d.total_bytes),
        d.phase
    );
    let _ = writeln!(
        w,
        "  parameters {}, activations and gradients {}, optimizer state {}, master weights {}; \
         optimizer step {}",
        format_size(d.parameter_bytes),
        format_size(d.activation_bytes),
        format_size(d.optimizer_state_bytes),
        format_size(d.master_weight_bytes),
        format_size(d.optimizer_step_bytes)
    );
    let memory = format_size(d.memory_bytes);
    let headroom = d.headroom();
    let _ = if headroom >= 0 {
        writeln!(
            w,
            "  fits in {memory} with {} to spare",
            format_size(headroom.unsigned_abs().try_into().unwrap_or(u64::MAX))
        )
    } else {
        writeln!(
            w,
            "  does not fit in {memory}: {} over",
            format_size(headroom.unsigned_abs().try_into().unwrap_or(u64::MAX))
        )
    };
}

fn text_diagnostics(w: &mut String, diagnostics: &[Diagnostic]) {
    if diagnostics.is_empty() {
        let _ = writeln!(w, "diagnostics: none");
        return;
    }
    let _ = writeln!(w, "diagnostics:");
    for d in diagnostics {
        let _ = writeln!(w, "{}[{}]: {}", d.level, d.code, d.message);
        let _ = writeln!(w, "  hint: {}", d.hint);
    }
}

/// Graphviz: nodes clustered by model and layer (backward apart), forward nodes coloured by
/// decision, replayed nodes outlined in red, and a legend.
pub fn dot(graph: &Graph, plan: &Plan) -> String {
    let mut decisions: Vec<Option<Decision>> = vec![None; graph.nodes().len()];
    for n in &plan.nodes {
        decisions[n.node.index()] = Some(n.decision);
    }
    let mut replayed = vec![false; graph.nodes().len()];
    for &n in plan.replay.iter().flat_map(|r| &r.nodes) {
        replayed[n.index()] = true;
    }
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "digraph \"{}\" {{", escape(&plan.graph.name));
    let _ = writeln!(
        w,
        "  compound=true; node [shape=box, style=filled, fontname=\"monospace\"];"
    );
    for (cluster, nodes) in dot_clusters(graph) {
        let _ = writeln!(w, "{}", cluster.open(graph));
        for id in nodes {
            let _ = writeln!(
                w,
                "{}",
                dot_node(graph, id, decisions[id.index()], replayed[id.index()])
            );
        }
        let _ = writeln!(w, "{}", cluster.close());
    }
    for (id, _) in graph.nodes().iter() {
        for succ in graph.successors(id) {
            let _ = writeln!(w, "  n{} -> n{};", id.index(), succ.index());
        }
    }
    dot_legend(w);
    let _ = writeln!(w, "}}");
    out
}

/// Where a node is drawn: its model (backward nodes apart), then its layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Cluster {
    model: ir::ModelId,
    backward: bool,
    layer: Option<u32>,
}

impl Cluster {
    fn open(&self, graph: &Graph) -> String {
        let model = &graph.model(self.model).name;
        let phase = if self.backward { " backward" } else { "" };
        let layer = self
            .layer
            .map_or_else(String::new, |l| format!(" layer {l}"));
        format!(
            "  subgraph cluster_{}_{}_{} {{ label=\"{}{phase}{layer}\";",
            self.model.index(),
            u8::from(self.backward),
            self.layer
                .map_or_else(|| "none".to_owned(), |l| l.to_string()),
            escape(model)
        )
    }

    fn close(&self) -> &'static str {
        "  }"
    }
}

/// The nodes of each cluster, clusters in model, phase and layer order.
fn dot_clusters(graph: &Graph) -> BTreeMap<Cluster, Vec<ir::NodeId>> {
    let mut clusters: BTreeMap<Cluster, Vec<ir::NodeId>> = BTreeMap::new();
    for (id, node) in graph.nodes().iter() {
        let backward = node.phase == Phase::Backward;
        let cluster = Cluster {
            model: node.model,
            backward,
            layer: node.layer.filter(|_| !backward),
        };
        clusters.entry(cluster).or_default().push(id);
    }
    clusters
}

fn dot_node(graph: &Graph, id: ir::NodeId, decision: Option<Decision>, replayed: bool) -> String {
    let node = graph.node(id);
    let fill = match (node.phase, decision) {
        (Phase::Backward, _) => "#dddddd",
        (_, Some(Decision::Save)) => "#8fd18f",
        (_, Some(Decision::Recompute)) => "#f5c27a",
        _ => "#ffffff",
    };
    let outline = if replayed {
        ", color=\"#d62728\", penwidth=3"
    } else {
        ""
    };
    format!(
        "    n{} [label=\"{}\\n{}\", fillcolor=\"{fill}\"{outline}];",
        id.index(),
        escape(&node.name),
        escape(&node.op)
    )
}

/// What the colours and outlines mean.
fn dot_legend(w: &mut String) {
    let _ = writeln!(
        w,
        "  subgraph cluster_legend {{ label=\"legend\"; node [shape=box, style=filled];"
    );
    for (name, label, style) in [
        ("save", "saved", "fillcolor=\"#8fd18f\""),
        ("recompute", "recomputed", "fillcolor=\"#f5c27a\""),
        (
            "replayed",
            "replayed in backward",
            "fillcolor=\"#f5c27a\", color=\"#d62728\", penwidth=3",
        ),
        ("no_checkpoint", "not checkpointed", "fillcolor=\"#ffffff\""),
        ("backward", "backward", "fillcolor=\"#dddddd\""),
    ] {
        let _ = writeln!(w, "    legend_{name} [label=\"{label}\", {style}];");
    }
    let _ = writeln!(w, "  }}");
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}
