//! Diagnostics (R7): every way a configuration silently fails to do what the user asked,
//! aggregated over the owning model and deduplicated per diagnosis (code + model + unit),
//! never keyed globally on an interval name.

use std::collections::{BTreeMap, BTreeSet};

use ir::{EntityId, Graph, ModelId, NodeId, Phase};

use crate::{
    config::{Keep, PlanConfig, Resolved},
    partition::Partition,
    policy::{Enclosed, Findings, Reason, Unbalance},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    Error,
    Warning,
    Info,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warning => "warning",
            Level::Info => "info",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Code {
    InplaceInKeptInterval,
    NoUnitsDeclared,
    MarkerMissing,
    IntervalInert,
    IntervalUnbalanced,
    IntervalOverlap,
    LayerCompiledAsOneRegion,
    NondeterministicReplay,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Code::InplaceInKeptInterval => "inplace-in-kept-interval",
            Code::NoUnitsDeclared => "no-units-declared",
            Code::MarkerMissing => "marker-missing",
            Code::IntervalInert => "interval-inert",
            Code::IntervalUnbalanced => "interval-unbalanced",
            Code::IntervalOverlap => "interval-overlap",
            Code::LayerCompiledAsOneRegion => "layer-compiled-as-one-region",
            Code::NondeterministicReplay => "nondeterministic-replay",
        }
    }

    fn level(self) -> Level {
        match self {
            Code::InplaceInKeptInterval => Level::Error,
            _ => Level::Warning,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Diagnostic {
    pub level: Level,
    pub code: Code,
    pub model: String,
    pub unit: Option<String>,
    /// Why, without a trailing period.
    pub message: String,
    /// What to do.
    pub hint: String,
}

/// Collects diagnostics keyed by (code, model, unit): the first report of a diagnosis wins.
#[derive(Default)]
struct Collector {
    by_key: BTreeMap<(Code, ModelId, Option<usize>), Diagnostic>,
}

impl Collector {
    fn add(
        &mut self,
        graph: &Graph,
        code: Code,
        (model, unit): (ModelId, Option<usize>),
        message: String,
        hint: String,
    ) {
        let declared = graph.model(model);
        self.by_key
            .entry((code, model, unit))
            .or_insert_with(|| Diagnostic {
                level: code.level(),
                code,
                model: declared.name.clone(),
                unit: unit.map(|u| declared.units[u].name.clone()),
                message,
                hint,
            });
    }

    fn finish(self) -> Vec<Diagnostic> {
        let mut all: Vec<Diagnostic> = self.by_key.into_values().collect();
        all.sort();
        all
    }
}

/// Everything worth telling the user about this configuration on this graph.
pub fn diagnose(
    graph: &Graph,
    config: &PlanConfig,
    resolved: &Resolved,
    findings: &Findings,
    partition: Option<&Partition>,
) -> Vec<Diagnostic> {
    let mut out = Collector::default();
    no_units_declared(graph, config, &mut out);
    marker_missing(graph, resolved, &mut out);
    interval_inert(graph, resolved, findings, &mut out);
    unbalanced(graph, findings, &mut out);
    overlaps(graph, findings, &mut out);
    inplace(graph, findings, &mut out);
    compiled_whole(graph, findings, &mut out);
    if let Some(partition) = partition {
        nondeterministic_replay(graph, partition, &mut out);
    }
    out.finish()
}

fn unit_name(graph: &Graph, model: ModelId, unit: usize) -> &str {
    &graph.model(model).units[unit].name
}

/// `layers 0, 1` / `layer 3`.
fn layers_phrase(layers: impl IntoIterator<Item = u32>) -> String {
    let layers: Vec<String> = layers.into_iter().map(|l| l.to_string()).collect();
    match layers.len() {
        1 => format!("layer {}", layers[0]),
        _ => format!("layers {}", layers.join(", ")),
    }
}

fn no_units_declared(graph: &Graph, config: &PlanConfig, out: &mut Collector) {
    if config.keep != Keep::All {
        return;
    }
    for (id, model) in graph.models().iter() {
        if model.units.is_empty() {
            out.add(
                graph,
                Code::NoUnitsDeclared,
                (id, None),
                format!(
                    "`--keep all` keeps nothing in model `{}`: it declares no recompute units",
                    model.name
                ),
                "declare the model's unit -> marker interval map in the exporter, or keep units of the other models by name".to_owned(),
            );
        }
    }
}

fn marker_missing(graph: &Graph, resolved: &Resolved, out: &mut Collector) {
    let mut present: BTreeMap<ModelId, BTreeSet<&str>> = BTreeMap::new();
    for node in graph.nodes().values() {
        if let Some(marker) = &node.marker {
            present.entry(node.model).or_default().insert(marker);
        }
    }
    let none = BTreeSet::new();
    for model in graph.models().ids() {
        let seen = present.get(&model).unwrap_or(&none);
        for unit in resolved.kept_anywhere(model) {
            let missing: Vec<String> = graph.model(model).units[unit]
                .intervals
                .iter()
                .flat_map(|i| [&i.begin, &i.end])
                .filter(|m| !seen.contains(m.as_str()))
                .map(|m| format!("`{m}`"))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            if missing.is_empty() {
                continue;
            }
            out.add(
                graph,
                Code::MarkerMissing,
                (model, Some(unit)),
                format!(
                    "unit {} of model `{}` keeps nothing where its marker {} is missing: {} appears in no layer of the model",
                    unit_name(graph, model, unit),
                    graph.model(model).name,
                    missing.join(", "),
                    if missing.len() == 1 { "it" } else { "they" },
                ),
                "record the marker with checkpoint_record(name, x) in the layer's forward, or fix the unit's interval map".to_owned(),
            );
        }
    }
}

fn interval_inert(graph: &Graph, resolved: &Resolved, findings: &Findings, out: &mut Collector) {
    for model in graph.models().ids() {
        for unit in resolved.kept_anywhere(model) {
            let key = (model, unit);
            let enclosed = findings.enclosed.get(&key);
            let inert: BTreeMap<u32, &Enclosed> = enclosed
                .into_iter()
                .flatten()
                .filter(|(_, e)| e.kept == 0)
                .map(|(&l, e)| (l, e))
                .collect();
            let fired: BTreeSet<u32> = enclosed.into_iter().flatten().map(|(&l, _)| l).collect();
            let silenced: BTreeMap<u32, &BTreeSet<String>> = findings
                .markers_in_compiled
                .get(&key)
                .into_iter()
                .flatten()
                .filter(|(l, _)| !fired.contains(l))
                .map(|(&l, r)| (l, r))
                .collect();
            if inert.is_empty() && silenced.is_empty() {
                continue;
            }
            let mut why = Vec::new();
            if !inert.is_empty() {
                why.push(format!(
                    "opened in {} and kept nothing: {}",
                    layers_phrase(inert.keys().copied()),
                    inert_cause(inert.values().copied())
                ));
            }
            if !silenced.is_empty() {
                let regions: BTreeSet<&String> = silenced.values().flat_map(|r| r.iter()).collect();
                why.push(format!(
                    "never opened in {}: its markers run inside compiled region {}, where markers never fire",
                    layers_phrase(silenced.keys().copied()),
                    quoted_list(regions)
                ));
            }
            out.add(
                graph,
                Code::IntervalInert,
                (model, Some(unit)),
                format!(
                    "unit {} of model `{}` {}",
                    unit_name(graph, model, unit),
                    graph.model(model).name,
                    why.join("; ")
                ),
                "a region counts only if its contents run in eager (R6): stop compiling what the interval encloses, or move the markers around eager ops".to_owned(),
            );
        }
    }
}

/// Why an interval that opened kept nothing.
fn inert_cause<'e>(enclosed: impl Iterator<Item = &'e Enclosed>) -> String {
    let mut total = Enclosed::default();
    for e in enclosed {
        total.kept += e.kept;
        for (reason, n) in &e.not_kept {
            *total.not_kept.entry(*reason).or_default() += n;
        }
        total
            .compiled_regions
            .extend(e.compiled_regions.iter().cloned());
    }
    if !total.compiled_regions.is_empty() {
        return format!(
            "its contents run in compiled region {}",
            quoted_list(&total.compiled_regions)
        );
    }
    if total.not_kept.is_empty() {
        return "its begin and end markers enclose no op".to_owned();
    }
    let parts: Vec<String> = total
        .not_kept
        .iter()
        .map(|(reason, n)| format!("{n} {}", reason_noun(*reason)))
        .collect();
    format!(
        "it encloses only {}, which are never kept",
        parts.join(", ")
    )
}

fn reason_noun(reason: Reason) -> &'static str {
    match reason {
        Reason::Mutable => "mutable op(s)",
        Reason::Collective => "collective(s)",
        Reason::View => "view(s)",
        Reason::Compiled => "compiled op(s)",
        _ => "op(s)",
    }
}

fn quoted_list<'a>(items: impl IntoIterator<Item = &'a String>) -> String {
    items
        .into_iter()
        .map(|s| format!("`{s}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn unbalanced(graph: &Graph, findings: &Findings, out: &mut Collector) {
    for (&(model, unit), cases) in &findings.unbalanced {
        let mut lines: BTreeMap<(Unbalance, &str), BTreeSet<u32>> = BTreeMap::new();
        for (layer, _, marker, kind) in cases {
            lines.entry((*kind, marker)).or_default().insert(*layer);
        }
        let parts: Vec<String> = lines
            .into_iter()
            .map(|((kind, marker), layers)| {
                let what = match kind {
                    Unbalance::EndWithoutBegin => "end without a begin (ignored)",
                    Unbalance::BeginWithoutEnd => {
                        "begin without an end (closed at the layer's end)"
                    }
                    Unbalance::BeginWhileOpen => "begin while already open (ignored)",
                };
                format!("`{marker}`: {what} in {}", layers_phrase(layers))
            })
            .collect();
        out.add(
            graph,
            Code::IntervalUnbalanced,
            (model, Some(unit)),
            format!(
                "unit {} of model `{}` has unbalanced markers: {}",
                unit_name(graph, model, unit),
                graph.model(model).name,
                parts.join("; ")
            ),
            "pair every `.begin` marker with its `.end` in the same layer and micro-batch"
                .to_owned(),
        );
    }
}

fn overlaps(graph: &Graph, findings: &Findings, out: &mut Collector) {
    let mut grouped: BTreeMap<((ModelId, usize), usize), BTreeSet<u32>> = BTreeMap::new();
    for &(key, other, layer) in &findings.overlaps {
        grouped.entry((key, other)).or_default().insert(layer);
    }
    for (((model, unit), other), layers) in grouped {
        out.add(
            graph,
            Code::IntervalOverlap,
            (model, Some(unit)),
            format!(
                "intervals of units {} and {} of model `{}` are open at once in {}: ops there are kept and attributed to {}",
                unit_name(graph, model, unit),
                unit_name(graph, model, other),
                graph.model(model).name,
                layers_phrase(layers),
                unit_name(graph, model, unit),
            ),
            "close one interval before opening the next if the units should stay separate".to_owned(),
        );
    }
}

fn inplace(graph: &Graph, findings: &Findings, out: &mut Collector) {
    let mut grouped: BTreeMap<(ModelId, usize), Vec<(NodeId, ir::ValueId)>> = BTreeMap::new();
    for &(key, node, value) in &findings.inplace_kept {
        grouped.entry(key).or_default().push((node, value));
    }
    for ((model, unit), cases) in grouped {
        let (node, value) = cases[0];
        let n = graph.node(node);
        let layers: BTreeSet<u32> = cases
            .iter()
            .filter_map(|&(id, _)| graph.node(id).layer)
            .collect();
        let more = match cases.len() {
            1 => String::new(),
            k => format!(" ({} more in-place writes)", k - 1),
        };
        out.add(
            graph,
            Code::InplaceInKeptInterval,
            (model, Some(unit)),
            format!(
                "in-place op `{}` ({}) writes `{}`, a tensor kept by unit {} in {}{more}: the kept value would be overwritten before backward reads it",
                n.name,
                n.op,
                graph.value(value).name,
                unit_name(graph, model, unit),
                layers_phrase(layers),
            ),
            "make the op out-of-place, or move it outside the kept interval".to_owned(),
        );
    }
}

fn compiled_whole(graph: &Graph, findings: &Findings, out: &mut Collector) {
    for (&model, layers) in &findings.layers_compiled_whole {
        let regions: BTreeSet<&String> = layers.values().collect();
        out.add(
            graph,
            Code::LayerCompiledAsOneRegion,
            (model, None),
            format!(
                "{} of model `{}` run as one compiled region ({}): no unit can keep anything there",
                layers_phrase(layers.keys().copied()),
                graph.model(model).name,
                quoted_list(regions)
            ),
            "compile smaller regions (as the expert-parallel config does) so kept regions run in eager".to_owned(),
        );
    }
}

/// Replay re-runs ops whose result can differ from forward and fixes shapes or indices
/// downstream: a tie in `topk` picks other experts or keys in backward than in forward.
fn nondeterministic_replay(graph: &Graph, partition: &Partition, out: &mut Collector) {
    // Per (model, enclosing unit): the ops replayed and the layers they are replayed in.
    type OpsAndLayers<'g> = (BTreeSet<&'g str>, BTreeSet<u32>);
    let mut grouped: BTreeMap<(ModelId, Option<usize>), OpsAndLayers> = BTreeMap::new();
    for replay in &partition.replays {
        for &id in &replay.nodes {
            let node = graph.node(id);
            if !node.info.replay_nondeterministic {
                continue;
            }
            let unit = enclosing_unit(graph, id);
            let entry = grouped.entry((node.model, unit)).or_default();
            entry.0.insert(node.op.as_str());
            entry.1.insert(replay.layer);
        }
    }
    for ((model, unit), (ops, layers)) in grouped {
        let ops: Vec<String> = ops.into_iter().map(|o| format!("`{o}`")).collect();
        let hint = match unit {
            Some(u) => format!(
                "keep unit {} to save the result instead of replaying it",
                unit_name(graph, model, u)
            ),
            None => "enclose the op in a unit's marker interval and keep that unit".to_owned(),
        };
        out.add(
            graph,
            Code::NondeterministicReplay,
            (model, unit),
            format!(
                "replay re-runs {} in {} of model `{}`: ties may resolve differently than in forward, and the result fixes shapes or indices downstream",
                ops.join(", "),
                layers_phrase(layers),
                graph.model(model).name
            ),
            hint,
        );
    }
}

/// The first declared unit of the node's model whose interval (in eager) was open when the node
/// ran: walks back through its layer's forward nodes of the same micro-batch; the nearest
/// marker of each unit tells whether it was open.
fn enclosing_unit(graph: &Graph, target: NodeId) -> Option<usize> {
    let t = graph.node(target);
    let units = &graph.model(t.model).units;
    let mut open: BTreeMap<usize, bool> = BTreeMap::new();
    for i in (0..target.index()).rev() {
        let node = graph.node(NodeId::from_index(i));
        if node.phase != Phase::Forward || node.model != t.model {
            continue;
        }
        if node.layer != t.layer {
            break;
        }
        if node.micro_batch != t.micro_batch || node.compiled_region.is_some() {
            continue;
        }
        let Some(marker) = node.marker.as_deref() else {
            continue;
        };
        for (u, unit) in units.iter().enumerate() {
            for interval in &unit.intervals {
                if interval.end == marker {
                    open.entry(u).or_insert(false);
                } else if interval.begin == marker {
                    open.entry(u).or_insert(true);
                }
            }
        }
    }
    open.into_iter()
        .find(|&(_, is_open)| is_open)
        .map(|(u, _)| u)
}
