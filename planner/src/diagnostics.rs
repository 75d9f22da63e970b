//! Diagnostics: every way a configuration silently fails to do what the user asked,
//! aggregated over the owning model and deduplicated per diagnosis (code + model + unit),
//! never keyed globally on an interval name.

use std::collections::{BTreeMap, BTreeSet};

use ir::{
    display::{name as shown, Shown},
    plan::{Code, Diagnostic, Keep, Level, Reason},
    EntityId, Graph, ModelId, Phase, UnitId, ValueId,
};

use crate::{
    config::{PlanConfig, Resolved},
    cost::HwProfile,
    memory::OffloadWindow,
    offload::{self, Refusal, Refused},
    partition::{Hazard, HazardKind, Partition},
    policy::{Demotion, Enclosed, Findings, InplaceWrite, Policy, Unbalance, UnitKey},
};

/// How bad a diagnosis is: an in-place write a replay cannot reproduce, or offload beyond the
/// host's memory, rejects the configuration.
pub fn level_of(code: Code) -> Level {
    match code {
        Code::InplaceInKeptInterval
        | Code::EagerReplayUnfaithful
        | Code::OffloadExceedsHostMemory => Level::Error,
        Code::KeptOutputWrittenInPlace | Code::RandomOpSaved | Code::RandomOpReplayed => {
            Level::Info
        }
        _ => Level::Warning,
    }
}

/// What diagnostics are deduplicated by: code, model and unit.
type DiagnosisKey = (Code, ModelId, Option<UnitId>);

/// Collects diagnostics keyed by (code, model, unit): the first report of a diagnosis wins.
#[derive(Default)]
struct Collector {
    by_key: BTreeMap<DiagnosisKey, Diagnostic>,
}

impl Collector {
    fn add(
        &mut self,
        code: Code,
        (model, unit): (ModelId, Option<UnitId>),
        message: String,
        hint: String,
    ) {
        self.by_key
            .entry((code, model, unit))
            .or_insert_with(|| Diagnostic {
                level: level_of(code),
                code,
                model,
                unit,
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
    policy: &Policy,
    partition: Option<&Partition>,
) -> Vec<Diagnostic> {
    let findings = &policy.findings;
    let mut out = Collector::default();
    no_layers_annotated(graph, &mut out);
    random_ops(graph, policy, &mut out);
    no_units_declared(graph, config, &mut out);
    marker_missing(graph, resolved, &mut out);
    interval_inert(graph, resolved, findings, &mut out);
    unbalanced(graph, findings, &mut out);
    crossings(graph, findings, &mut out);
    inplace(graph, findings, &mut out);
    demoted(graph, findings, &mut out);
    compiled_whole(graph, findings, &mut out);
    if let Some(partition) = partition {
        eager_hazards(graph, partition, &mut out);
        nondeterministic_replay(graph, (config, resolved), findings, partition, &mut out);
    }
    out.finish()
}

/// Names in messages come from the graph file: they are escaped and long ones shortened, so
/// one diagnostic stays one line.
fn unit_name(graph: &Graph, model: ModelId, unit: UnitId) -> Shown<'_> {
    shown(&graph.model(model).units[unit].name)
}

fn model_name(graph: &Graph, model: ModelId) -> Shown<'_> {
    shown(&graph.model(model).name)
}

/// Ranges of layers shown before the rest are counted.
const SHOWN_RANGES: usize = 8;

/// `layer 3` / `layers 0, 1` / `layers 0-2, 5, 7-9`: runs of three or more layers as ranges, at most
/// [`SHOWN_RANGES`] of them and a count of the rest, so a deep model's message stays short.
fn layers_phrase(layers: impl IntoIterator<Item = u32>) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for layer in layers {
        match ranges.last_mut() {
            Some((_, last)) if last.checked_add(1) == Some(layer) => *last = layer,
            _ => ranges.push((layer, layer)),
        }
    }
    let single = matches!(ranges.as_slice(), [(first, last)] if first == last);
    let mut shown: Vec<String> = ranges
        .iter()
        .take(SHOWN_RANGES)
        .map(|&(first, last)| match last - first {
            0 => first.to_string(),
            1 => format!("{first}, {last}"),
            _ => format!("{first}-{last}"),
        })
        .collect();
    if ranges.len() > SHOWN_RANGES {
        shown.push(format!("and {} more", ranges.len() - SHOWN_RANGES));
    }
    let noun = if single { "layer" } else { "layers" };
    format!("{noun} {}", shown.join(", "))
}

fn no_units_declared(graph: &Graph, config: &PlanConfig, out: &mut Collector) {
    if config.keep != Keep::All {
        return;
    }
    for (id, model) in graph.models().iter() {
        if model.units.is_empty() {
            out.add(
                Code::NoUnitsDeclared,
                (id, None),
                format!(
                    "`--keep all` keeps nothing in model `{}`: it declares no recompute units",
                    shown(&model.name)
                ),
                "declare the model's unit -> marker interval map in the exporter, or keep units of the other models by name".to_owned(),
            );
        }
    }
}

fn marker_missing(graph: &Graph, resolved: &Resolved, out: &mut Collector) {
    let mut present: BTreeMap<ModelId, BTreeSet<&str>> = BTreeMap::new();
    for node in graph.nodes().values() {
        if let Some(marker) = node.marker() {
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
                .map(|m| format!("`{}`", shown(m)))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            if missing.is_empty() {
                continue;
            }
            out.add(
                Code::MarkerMissing,
                (model, Some(unit)),
                format!(
                    "unit {} of model `{}` keeps nothing where its marker {} is missing: {} appears in no layer of the model",
                    unit_name(graph, model, unit),
                    model_name(graph, model),
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
            let key = UnitKey { model, unit };
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
                Code::IntervalInert,
                (model, Some(unit)),
                format!(
                    "unit {} of model `{}` {}",
                    unit_name(graph, model, unit),
                    model_name(graph, model),
                    why.join("; ")
                ),
                "a region counts only if its contents run in eager: stop compiling what the interval encloses, or move the markers around eager ops".to_owned(),
            );
        }
    }
}

/// Why an interval that opened kept nothing.
fn inert_cause<'e>(enclosed: impl Iterator<Item = &'e Enclosed>) -> String {
    let mut total = Enclosed::default();
    for e in enclosed {
        total.absorb(e);
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
        .map(|s| format!("`{}`", shown(s)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn unbalanced(graph: &Graph, findings: &Findings, out: &mut Collector) {
    for (&UnitKey { model, unit }, faults) in &findings.unbalanced {
        let mut lines: BTreeMap<(Unbalance, &str), BTreeSet<u32>> = BTreeMap::new();
        for f in faults {
            lines
                .entry((f.kind, &f.marker))
                .or_default()
                .insert(f.layer);
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
                format!("`{}`: {what} in {}", shown(marker), layers_phrase(layers))
            })
            .collect();
        out.add(
            Code::IntervalUnbalanced,
            (model, Some(unit)),
            format!(
                "unit {} of model `{}` has unbalanced markers: {}",
                unit_name(graph, model, unit),
                model_name(graph, model),
                parts.join("; ")
            ),
            "pair every `.begin` marker with its `.end` in the same layer and micro-batch"
                .to_owned(),
        );
    }
}

/// Intervals that cross (one opens inside the other and closes after it); nested ones are
/// fine and not reported.
fn crossings(graph: &Graph, findings: &Findings, out: &mut Collector) {
    let mut grouped: BTreeMap<(UnitKey, UnitId), BTreeSet<u32>> = BTreeMap::new();
    for c in &findings.crossings {
        grouped
            .entry((c.unit, c.other))
            .or_default()
            .insert(c.layer);
    }
    for ((UnitKey { model, unit }, other), layers) in grouped {
        out.add(
            Code::IntervalOverlap,
            (model, Some(unit)),
            format!(
                "intervals of units {} and {} of model `{}` cross in {}: {} opens inside {} and closes after it, so ops in between are kept and credited to {}",
                unit_name(graph, model, unit),
                unit_name(graph, model, other),
                model_name(graph, model),
                layers_phrase(layers),
                unit_name(graph, model, other),
                unit_name(graph, model, unit),
                unit_name(graph, model, other),
            ),
            "nest the intervals (close the inner one first) or close one before opening the other".to_owned(),
        );
    }
}

fn inplace(graph: &Graph, findings: &Findings, out: &mut Collector) {
    let mut grouped: BTreeMap<UnitKey, Vec<&InplaceWrite>> = BTreeMap::new();
    for w in &findings.inplace_kept {
        grouped.entry(w.unit).or_default().push(w);
    }
    for (UnitKey { model, unit }, writes) in grouped {
        let first = writes[0];
        let n = graph.node(first.node);
        let layers: BTreeSet<u32> = writes
            .iter()
            .filter_map(|w| graph.node(w.node).layer)
            .collect();
        let more = match writes.len() {
            1 => String::new(),
            k => format!(" ({} more in-place writes)", k - 1),
        };
        out.add(
            Code::InplaceInKeptInterval,
            (model, Some(unit)),
            format!(
                "in-place op `{}` ({}) writes `{}`, a tensor kept by unit {} in {}{more}: the kept value would be overwritten before backward reads it",
                shown(&n.name),
                shown(&n.op),
                shown(&graph.value(first.value).name),
                unit_name(graph, model, unit),
                layers_phrase(layers),
            ),
            "make the op out-of-place, or move it outside the kept interval".to_owned(),
        );
    }
}

fn demoted(graph: &Graph, findings: &Findings, out: &mut Collector) {
    let mut grouped: BTreeMap<UnitKey, Vec<&Demotion>> = BTreeMap::new();
    for d in &findings.demoted {
        grouped.entry(d.unit).or_default().push(d);
    }
    for (UnitKey { model, unit }, demoted) in grouped {
        let first = demoted[0];
        let (kept, writer) = (graph.node(first.node), graph.node(first.writer));
        let layers: BTreeSet<u32> = demoted
            .iter()
            .filter_map(|d| graph.node(d.node).layer)
            .collect();
        let more = match demoted.len() {
            1 => String::new(),
            k => format!(" ({} more such ops)", k - 1),
        };
        out.add(
            Code::KeptOutputWrittenInPlace,
            (model, Some(unit)),
            format!(
                "unit {} keeps `{}` ({}) in {}, but `{}` ({}) writes its output in place later{more}: it is recomputed and replays with its writers instead of being saved",
                unit_name(graph, model, unit),
                shown(&kept.name),
                shown(&kept.op),
                layers_phrase(layers),
                shown(&writer.name),
                shown(&writer.op),
            ),
            "make the write out-of-place (`w = w / s` instead of `w /= s`) if the op should be kept".to_owned(),
        );
    }
}

fn compiled_whole(graph: &Graph, findings: &Findings, out: &mut Collector) {
    for (&model, layers) in &findings.layers_compiled_whole {
        let regions: BTreeSet<&String> = layers.values().collect();
        out.add(
            Code::LayerCompiledAsOneRegion,
            (model, None),
            format!(
                "{} of model `{}` run as one compiled region ({}): no unit can keep anything there",
                layers_phrase(layers.keys().copied()),
                model_name(graph, model),
                quoted_list(regions)
            ),
            "compile smaller regions (as the expert-parallel config does) so kept regions run in eager".to_owned(),
        );
    }
}

/// What the replayed nondeterministic ops of one (model, enclosing unit) have in common.
#[derive(Default)]
struct Replayed<'g> {
    ops: BTreeSet<&'g str>,
    layers: BTreeSet<u32>,
    /// Compiled regions some of them run in.
    regions: BTreeSet<String>,
}

/// Replay re-runs ops whose result can differ from forward and fixes shapes or indices
/// downstream: a tie in `topk` picks other experts or keys in backward than in forward. The
/// hint names the unit whose interval encloses the op, as the policy's marker walk saw it.
fn nondeterministic_replay(
    graph: &Graph,
    (config, resolved): (&PlanConfig, &Resolved),
    findings: &Findings,
    partition: &Partition,
    out: &mut Collector,
) {
    let mut grouped: BTreeMap<(ModelId, Option<UnitId>), Replayed> = BTreeMap::new();
    for replay in &partition.replays {
        for &id in &replay.nodes {
            let Some(&unit) = findings.nondeterministic.get(&id) else {
                continue;
            };
            let node = graph.node(id);
            let entry = grouped.entry((node.model, unit)).or_default();
            entry.ops.insert(node.op.as_str());
            entry.layers.insert(replay.layer.layer);
            if let Some(region) = &node.compiled_region {
                entry.regions.insert(region.to_string());
            }
        }
    }
    for ((model, unit), replayed) in grouped {
        let ops: Vec<String> = replayed
            .ops
            .iter()
            .map(|o| format!("`{}`", shown(o)))
            .collect();
        out.add(
            Code::NondeterministicReplay,
            (model, unit),
            format!(
                "replay re-runs {} in {} of model `{}`: ties may resolve differently than in forward, and the result fixes shapes or indices downstream",
                ops.join(", "),
                layers_phrase(replayed.layers.iter().copied()),
                model_name(graph, model)
            ),
            nondeterministic_hint(graph, (config, resolved), model, unit, &replayed.regions),
        );
    }
}

/// Whether keeping `unit` of `model` everywhere would be rejected (an in-place write in its
/// interval that cannot replay): a hint must not recommend it. Answered by the policy itself,
/// run with the unit kept.
fn keeping_is_rejected(
    graph: &Graph,
    (config, resolved): (&PlanConfig, &Resolved),
    model: ModelId,
    unit: UnitId,
) -> bool {
    let mut with_unit = resolved.clone();
    with_unit.layer_units.clear();
    if !with_unit.kept_units[model].contains(&unit) {
        with_unit.kept_units[model].push(unit);
    }
    let what_if = crate::policy::apply(graph, config, &with_unit);
    let key = UnitKey { model, unit };
    what_if.findings.inplace_kept.iter().any(|w| w.unit == key)
}

fn nondeterministic_hint(
    graph: &Graph,
    configs: (&PlanConfig, &Resolved),
    model: ModelId,
    unit: Option<UnitId>,
    regions: &BTreeSet<String>,
) -> String {
    if let Some(u) = unit.filter(|&u| keeping_is_rejected(graph, configs, model, u)) {
        return format!(
            "unit {} encloses the op, but keeping it is rejected here (an in-place write in its interval cannot replay): make that write out-of-place, or enclose the op in an interval of its own",
            unit_name(graph, model, u)
        );
    }
    match (unit, regions.is_empty()) {
        (Some(u), false) => format!(
            "unit {} encloses the op, but it runs in compiled region {}, where nothing is kept: compile less so that it runs in eager, then keep {}",
            unit_name(graph, model, u),
            quoted_list(regions),
            unit_name(graph, model, u)
        ),
        (Some(u), true) => format!(
            "keep unit {} to save the result instead of replaying it",
            unit_name(graph, model, u)
        ),
        (None, _) => "enclose the op in a unit's marker interval and keep that unit".to_owned(),
    }
}

/// Random ops in checkpointed layers, by model and by what happens to them: saved, or replayed
/// with the generator state forward saw (which every executor must restore).
fn random_ops(graph: &Graph, policy: &Policy, out: &mut Collector) {
    let mut grouped: BTreeMap<(ModelId, Reason), Replayed> = BTreeMap::new();
    for (id, p) in policy.nodes.iter() {
        let Some(p) = p.filter(|p| matches!(p.reason, Reason::Random | Reason::RandomReplayed))
        else {
            continue;
        };
        let node = graph.node(id);
        let entry = grouped.entry((node.model, p.reason)).or_default();
        entry.ops.insert(node.op.as_str());
        entry.layers.extend(node.layer);
    }
    for ((model, reason), found) in grouped {
        let ops: Vec<String> = found
            .ops
            .iter()
            .map(|o| format!("`{}`", shown(o)))
            .collect();
        let (code, what, hint) = if reason == Reason::Random {
            (
                Code::RandomOpSaved,
                "are saved, so replay never draws other random numbers",
                "`--random-ops replay` replays them instead, with the generator state forward saw restored (less memory; the executor must restore the state)",
            )
        } else {
            (
                Code::RandomOpReplayed,
                "replay with the generator state forward saw: the executor must restore it (the runtime does; eager checkpoint does with preserve_rng_state=True; torch.compile needs functionalize_rng_ops)",
                "`--random-ops save` saves their outputs instead, which every executor honours but eager checkpointing of CPU dropout (eager runs it as an in-place `bernoulli_`, which the checkpoint cannot cache)",
            )
        };
        out.add(
            code,
            (model, None),
            format!(
                "random ops {} in {} of model `{}` {what}",
                ops.join(", "),
                layers_phrase(found.layers.iter().copied()),
                model_name(graph, model)
            ),
            hint.to_owned(),
        );
    }
}

/// A model of which nothing can be checkpointed: it declares no decoder layers, or declares
/// some but none of its forward nodes carries a layer index. Either is almost always a
/// forgotten annotation, and every plan of such a model is "no checkpointing".
fn no_layers_annotated(graph: &Graph, out: &mut Collector) {
    let models = graph.models().len();
    let mut has_forward = vec![false; models];
    let mut annotated = vec![false; models];
    for node in graph.nodes().values() {
        if node.phase == Phase::Forward {
            has_forward[node.model.index()] = true;
            annotated[node.model.index()] |= node.layer.is_some();
        }
    }
    for (id, model) in graph.models().iter() {
        if !has_forward[id.index()] || annotated[id.index()] {
            continue;
        }
        let declared = match model.num_layers {
            0 => "declares no decoder layers".to_owned(),
            n => format!("declares {n} layers, but none of its forward ops carries a layer index"),
        };
        out.add(
            Code::NoLayersAnnotated,
            (id, None),
            format!(
                "model `{}` {declared}: nothing of it is checkpointed",
                shown(&model.name)
            ),
            "when exporting, annotate the model first (`recompute_planner.annotate(model, layers=\"model.layers\", units=...)`) or run each decoder layer inside `layer_scope(model, index)`, so its ops carry their layer".to_owned(),
        );
    }
}

/// Under eager checkpointing the plan's peak exceeds the step without checkpointing: the
/// selective-checkpoint cache holds every output of each kept op until the layer's recompute
/// (those backward never reads too), and the recompute adds its own tensors on top.
pub fn eager_costs_memory(
    graph: &Graph,
    partition: &Partition,
    peak_bytes: u64,
    no_checkpoint_peak_bytes: u64,
) -> Option<Diagnostic> {
    if partition.holds.is_empty() || peak_bytes <= no_checkpoint_peak_bytes {
        return None;
    }
    let cached = crate::plan::activation_bytes(
        graph,
        partition
            .saved
            .iter()
            .filter(|s| s.kind == ir::plan::SavedKind::Kept),
    );
    let model = partition
        .replays
        .first()
        .map_or(ModelId::from_index(0), |r| r.layer.model);
    let mut out = Collector::default();
    out.add(
        Code::EagerCheckpointCostsMemory,
        (model, None),
        format!(
            "under eager checkpointing this plan peaks at {peak_bytes} B, above the {no_checkpoint_peak_bytes} B of no checkpointing: the selective-checkpoint cache holds every output of each kept op ({cached} B, outputs backward never reads included) until its layer recomputes, and the recompute re-runs the layer's other ops up to the last one backward reads on top of them"
        ),
        "keep fewer units (`--keep none` recomputes whole layers), or run the plan with a graph executor (`--executor graph`), which saves only what backward reads".to_owned(),
    );
    out.finish().pop()
}

/// An eager recompute that re-runs an in-place write of a resident tensor, or reads one after
/// forward wrote it, computes something else than forward did.
fn eager_hazards(graph: &Graph, partition: &Partition, out: &mut Collector) {
    let mut by_model: BTreeMap<ModelId, Vec<&Hazard>> = BTreeMap::new();
    for h in &partition.hazards {
        by_model.entry(h.layer.model).or_default().push(h);
    }
    for (model, hazards) in by_model {
        let first = hazards[0];
        let node = graph.node(first.node);
        let what = match first.kind {
            HazardKind::WritesResident => format!(
                "writes `{}` in place again, though it is resident and already holds that write",
                shown(&graph.value(first.value).name)
            ),
            HazardKind::ReadsOverwritten { writer } => format!(
                "reads `{}` after forward wrote it in place (`{}`), not as forward read it",
                shown(&graph.value(first.value).name),
                shown(&graph.node(writer).name)
            ),
        };
        let layers: BTreeSet<u32> = hazards.iter().map(|h| h.layer.layer).collect();
        let more = match hazards.len() {
            1 => String::new(),
            k => format!(" ({} more such ops)", k - 1),
        };
        out.add(
            Code::EagerReplayUnfaithful,
            (model, None),
            format!(
                "eager recompute of {} of model `{}` re-runs `{}` ({}), which {what}{more}: the recompute would not reproduce forward",
                layers_phrase(layers),
                model_name(graph, model),
                shown(&node.name),
                shown(&node.op),
            ),
            "run the plan with a graph executor (`--executor graph`: the runtime, torch.compile), or make the in-place write out-of-place".to_owned(),
        );
    }
}

/// What became of the storages `--offload` and `--offload-kinds` asked to move: those kept on
/// the device (a saved view of them is not offloaded, they are written in place, or the device
/// is never free of them before backward needs them back), and those moved whose copy costs
/// more to launch than to move. One diagnostic per (code, model, unit), naming the first value
/// and counting the others. Then whether the most the host holds at once, `host_peak_bytes`,
/// fits in the profile's host memory.
pub fn offload(
    graph: &Graph,
    policy: &Policy,
    refused: &[Refused],
    windows: &[OffloadWindow],
    host_peak_bytes: u64,
    hw: &HwProfile,
) -> Vec<Diagnostic> {
    // Per diagnosis: the first value's message and hint, and how many values it stands for.
    let mut found: BTreeMap<DiagnosisKey, (String, String, usize)> = BTreeMap::new();
    let mut report = |code: Code, value: ValueId, message: String, hint: String| {
        let (model, unit) = offload::owner(graph, policy, value);
        found
            .entry((code, model, unit))
            .or_insert((message, hint, 0))
            .2 += 1;
    };
    for r in refused {
        let (code, message, hint) = refused_offload(graph, r);
        report(code, r.root, message, hint);
    }
    for w in windows {
        if let Some((code, message, hint)) = unhelpful_offload(graph, w, hw) {
            report(code, w.value, message, hint);
        }
    }
    let mut out = Collector::default();
    for ((code, model, unit), (message, hint, count)) in found {
        let more = match count {
            1 => String::new(),
            2 => " (1 more such value)".to_owned(),
            k => format!(" ({} more such values)", k - 1),
        };
        out.add(code, (model, unit), format!("{message}{more}"), hint);
    }
    let host_memory = hw.host_memory_bytes as u64;
    if host_peak_bytes > host_memory {
        out.add(
            Code::OffloadExceedsHostMemory,
            (ModelId::from_index(0), None),
            format!(
                "the offloaded values take up to {host_peak_bytes} B of host memory at once, more than the {host_memory} B the hardware profile `{}` gives one device (`host_memory_bytes`)",
                hw.name
            ),
            "offload fewer values (--offload, --offload-kinds), or state the host memory one device may use in a profile (`host_memory_bytes`, --hw PROFILE.json)".to_owned(),
        );
    }
    out.finish()
}

/// The diagnosis of a storage kept on the device although offload was asked for.
fn refused_offload(graph: &Graph, r: &Refused) -> (Code, String, String) {
    let value = shown(&graph.value(r.root).name);
    match r.why {
        Refusal::AliasedOnDevice { view } => (
            Code::OffloadAliasedOnDevice,
            format!(
                "`{value}` stays on the device although offload was asked for: `{}` shares its storage and is saved on the device, not offloaded",
                shown(&graph.value(view).name)
            ),
            "offload what saves the other value too (its unit with --offload, or its saved kind with --offload-kinds)".to_owned(),
        ),
        Refusal::WrittenInPlace { writer } => (
            Code::OffloadWrittenInPlace,
            format!(
                "`{value}` stays on the device although offload was asked for: `{}` writes its storage in place, so the storage holds more than one version of the tensor and a host copy of one is not what every read of it expects",
                shown(&graph.node(writer).name)
            ),
            "make the in-place write out-of-place in the model, or offload other values".to_owned(),
        ),
    }
}

/// The last step the device keeps an offloaded storage for, in words: its last forward read,
/// or where a checkpoint's frame lets its device tensor go.
fn held_through(w: &OffloadWindow) -> String {
    if w.held_until > w.last_forward_read {
        format!(
            "the checkpoint frame holding it on the device (to step {})",
            w.held_until
        )
    } else {
        format!("its last forward read (step {})", w.last_forward_read)
    }
}

/// Why the device is never free of `value`'s storage: its reload comes too soon after it may
/// leave, or, with no reload, it is held to the end of the step.
fn no_gap(value: &str, w: &OffloadWindow) -> String {
    match (w.reload_at, w.first_backward_read) {
        (Some(reload_at), Some(first)) => format!(
            "`{value}` stays on the device although offload was asked for: {} is too close to its reload (step {reload_at}, before its first backward read at step {first}), so the device is never free of it",
            held_through(w),
        ),
        _ => format!(
            "`{value}` stays on the device although offload was asked for: {} lasts to the end of the step, so the device is never free of it",
            held_through(w),
        ),
    }
}

/// The diagnosis of an offload that cannot help: the device is never free of the storage
/// before its reload (kept on the device), or it is moved but smaller than what the copy costs
/// to launch.
fn unhelpful_offload(
    graph: &Graph,
    w: &OffloadWindow,
    hw: &HwProfile,
) -> Option<(Code, String, String)> {
    let value = shown(&graph.value(w.value).name);
    if !w.moved {
        return Some((Code::OffloadNoGap, no_gap(&value.to_string(), w), "lower --offload-prefetch, or offload values forward is done with early (a layer's inputs, what its first ops make)".to_owned()));
    }
    offload::too_small(hw, w.bytes).then(|| {
        (
            Code::OffloadTooSmall,
            format!(
                "`{value}` ({} B) is offloaded, but it moves over the host link faster than the {} a copy costs to launch: the copies cost more time than the bytes they move justify",
                w.bytes,
                crate::units::format_seconds(hw.op_overhead_s),
            ),
            "offload larger values (a layer's inputs, an attention's scores), or keep this one on the device".to_owned(),
        )
    })
}
