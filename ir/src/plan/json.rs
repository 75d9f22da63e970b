//! The plan's JSON: the proto3 JSON of `plan.proto` with the proto field names as keys and
//! 64-bit integers as numbers, pretty-printed with a final newline. Any proto3 JSON parser reads
//! it (Python's `json_format.Parse` into the generated `Plan`, for one); this module reads it
//! through the same wire message as the `.pb` form, so both formats have one conversion.
//!
//! serde writes it from the typed plan: each part of the plan is serialized through a view
//! that borrows it and names its ids (`PlanNames`) as it goes, so a million-node plan (120 MB
//! of JSON) is written without building its named form first. The views' fields are the proto
//! fields (`planner/tests/plan_formats.rs` holds them to `plan.proto`), in the order the golden
//! plans hold (`cli/tests/golden_plans.rs`).

use serde::{Serialize, Serializer};

use super::{
    Config, Cost, Diagnostic, LayerKeep, LayerOffload, Memory, NodeDecision, Plan, PlanNames,
    PlanReadError, Replay, SavedValue, UnitLayer, UnitSummary,
};
use crate::{wire::plan as pb, NodeId};

/// The JSON text of `plan`, its ids named by `names`, as UTF-8 bytes. The buffer is sized
/// for the plan up front: growing a 120 MB text by doubling copies it again and again, into
/// fresh memory each time.
pub fn write(plan: &Plan, names: &dyn PlanNames) -> Vec<u8> {
    let mut text = Vec::with_capacity(capacity_for(plan));
    serde_json::to_writer_pretty(&mut text, &PlanJson::of(plan, names))
        .expect("a plan serializes to memory");
    text.push(b'\n');
    text
}

/// An upper estimate of the JSON text's length: about 200 bytes per node decision and saved
/// value as written, 40 per replayed node; memory reserved and never written costs nothing.
fn capacity_for(plan: &Plan) -> usize {
    let replayed: usize = plan.replay.iter().map(|r| r.nodes.len()).sum();
    (plan.nodes.len() + plan.saved.len())
        .saturating_mul(256)
        .saturating_add(replayed.saturating_mul(48))
        .saturating_add(1 << 16)
}

/// The JSON of per-layer unit choices (a Pareto point's), as a plan's config writes them.
pub fn layer_keep_value(layer_keep: &[LayerKeep], names: &dyn PlanNames) -> serde_json::Value {
    serde_json::to_value(Each::new(layer_keep, |l| LayerKeepJson::of(l, names)))
        .expect("layer choices serialize")
}

/// Per-layer offload choices as a plan's `config.layer_offload` writes them (a `pareto` point's
/// offloaded units).
pub fn layer_offload_value(
    layer_offload: &[LayerOffload],
    names: &dyn PlanNames,
) -> serde_json::Value {
    serde_json::to_value(Each::new(layer_offload, |l| LayerOffloadJson::of(l, names)))
        .expect("layer choices serialize")
}

pub(super) fn decode(bytes: &[u8]) -> Result<pb::Plan, PlanReadError> {
    serde_json::from_slice(bytes).map_err(|e| PlanReadError::Json(plain_error(bytes, &e)))
}

/// What pbjson says of a number it cannot read (out of range, negative for an unsigned field,
/// a fraction, a string of something else than digits).
const PBJSON_BAD_NUMBER: &str = "data did not match any variant of untagged enum Content";

/// serde_json's message for `json`, with pbjson's words for a bad number replaced by plain
/// ones naming the key whose value it is.
fn plain_error(json: &[u8], error: &serde_json::Error) -> String {
    let message = error.to_string();
    if !message.starts_with(PBJSON_BAD_NUMBER) {
        return message;
    }
    let key = key_before(json, error.line(), error.column()).unwrap_or("a number field");
    message.replacen(
        PBJSON_BAD_NUMBER,
        &format!("`{key}` must be a whole number in its range (a number or a string of digits)"),
        1,
    )
}

/// The object key whose value ends at `line`, `column` (serde_json's 1-based position): the
/// last `"key":` before it.
fn key_before(json: &[u8], line: usize, column: usize) -> Option<&str> {
    let line_start = match line {
        0 | 1 => 0,
        _ => json
            .iter()
            .enumerate()
            .filter(|&(_, &b)| b == b'\n')
            .nth(line - 2)
            .map(|(i, _)| i + 1)?,
    };
    let before = json.get(..line_start.saturating_add(column).min(json.len()))?;
    let colon = before.iter().rposition(|&b| b == b':')?;
    let quoted = before[..colon].trim_ascii_end().strip_suffix(b"\"")?;
    let open = quoted.iter().rposition(|&b| b == b'"')?;
    std::str::from_utf8(&quoted[open + 1..]).ok()
}

/// `items`, each serialized as the view `view` makes of it.
struct Each<'a, T, V> {
    items: &'a [T],
    view: Box<dyn Fn(&'a T) -> V + 'a>,
}

impl<'a, T, V> Each<'a, T, V> {
    fn new(items: &'a [T], view: impl Fn(&'a T) -> V + 'a) -> Self {
        Each {
            items,
            view: Box::new(view),
        }
    }
}

impl<T, V: Serialize> Serialize for Each<'_, T, V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.items.iter().map(|item| (self.view)(item)))
    }
}

#[derive(Serialize)]
struct PlanJson<'a> {
    planner_version: &'a str,
    graph: GraphJson<'a>,
    config: ConfigJson<'a>,
    joint: bool,
    nodes: Each<'a, NodeDecision, NodeJson<'a>>,
    saved: Each<'a, SavedValue, SavedJson<'a>>,
    replay: Each<'a, Replay, ReplayJson<'a>>,
    units: Each<'a, UnitSummary, UnitJson<'a>>,
    memory: MemoryJson<'a>,
    cost: &'a Cost,
    diagnostics: Each<'a, Diagnostic, DiagnosticJson<'a>>,
}

impl<'a> PlanJson<'a> {
    fn of(p: &'a Plan, names: &'a dyn PlanNames) -> Self {
        PlanJson {
            planner_version: &p.planner_version,
            graph: GraphJson {
                name: &p.graph.name,
                fingerprint: &p.graph.fingerprint,
            },
            config: ConfigJson::of(&p.config, names),
            joint: p.joint,
            nodes: Each::new(&p.nodes, |n| NodeJson::of(n, names)),
            saved: Each::new(&p.saved, |s| SavedJson::of(s, names)),
            replay: Each::new(&p.replay, |r| ReplayJson::of(r, names)),
            units: Each::new(&p.units, |u| UnitJson::of(u, names)),
            memory: MemoryJson::of(&p.memory, names),
            cost: &p.cost,
            diagnostics: Each::new(&p.diagnostics, |d| DiagnosticJson::of(d, names)),
        }
    }
}

#[derive(Serialize)]
struct GraphJson<'a> {
    name: &'a str,
    fingerprint: &'a str,
}

#[derive(Serialize)]
struct ConfigJson<'a> {
    keep: Vec<String>,
    recompute_ratio: f64,
    collectives: &'static str,
    random_ops: &'static str,
    executor: &'static str,
    budget_bytes: Option<u64>,
    layer_keep: Each<'a, LayerKeep, LayerKeepJson<'a>>,
    fsdp: u32,
    optimizer: &'static str,
    optimizer_state_dtype: &'static str,
    master_weights: bool,
    offload: &'a [String],
    offload_kinds: Vec<&'static str>,
    offload_prefetch: u32,
    layer_offload: Each<'a, LayerOffload, LayerOffloadJson<'a>>,
}

impl<'a> ConfigJson<'a> {
    fn of(c: &'a Config, names: &'a dyn PlanNames) -> Self {
        ConfigJson {
            keep: c.keep.names(),
            recompute_ratio: c.recompute_ratio,
            collectives: c.collectives.name(),
            random_ops: c.random_ops.name(),
            executor: c.executor.name(),
            budget_bytes: c.budget_bytes,
            layer_keep: Each::new(&c.layer_keep, |l| LayerKeepJson::of(l, names)),
            fsdp: c.training.fsdp,
            optimizer: c.training.optimizer.name(),
            optimizer_state_dtype: c.training.state_dtype.name(),
            master_weights: c.training.master_weights,
            offload: &c.offload.units,
            offload_kinds: c.offload.kinds.iter().map(|k| k.name()).collect(),
            offload_prefetch: c.offload.prefetch,
            layer_offload: Each::new(&c.layer_offload, |l| LayerOffloadJson::of(l, names)),
        }
    }
}

/// `{"model", "layer", "keep"}`: the choices `plan --choices` reads.
#[derive(Serialize)]
struct LayerKeepJson<'a> {
    model: &'a str,
    layer: u32,
    keep: Vec<&'a str>,
}

impl<'a> LayerKeepJson<'a> {
    fn of(l: &'a LayerKeep, names: &'a dyn PlanNames) -> Self {
        LayerKeepJson {
            model: names.model(l.at.model),
            layer: l.at.layer,
            keep: l.units.iter().map(|&u| names.unit(l.at.model, u)).collect(),
        }
    }
}

/// `{"model", "layer", "offload", "layer_input"}`: what one layer moves to the host (the
/// saved values of its units `offload`, and its layer inputs where `layer_input`).
#[derive(Serialize)]
struct LayerOffloadJson<'a> {
    model: &'a str,
    layer: u32,
    offload: Vec<&'a str>,
    layer_input: bool,
}

impl<'a> LayerOffloadJson<'a> {
    fn of(l: &'a LayerOffload, names: &'a dyn PlanNames) -> Self {
        LayerOffloadJson {
            model: names.model(l.at.model),
            layer: l.at.layer,
            offload: l.units.iter().map(|&u| names.unit(l.at.model, u)).collect(),
            layer_input: l.layer_input,
        }
    }
}

#[derive(Serialize)]
struct NodeJson<'a> {
    name: &'a str,
    op: &'a str,
    model: &'a str,
    layer: Option<u32>,
    decision: &'static str,
    reason: &'static str,
    unit: Option<&'a str>,
    offloaded: bool,
}

impl<'a> NodeJson<'a> {
    fn of(n: &NodeDecision, names: &'a dyn PlanNames) -> Self {
        NodeJson {
            name: names.node(n.node),
            op: names.op(n.node),
            model: names.model(n.model),
            layer: n.layer,
            decision: n.decision.name(),
            reason: n.reason.name(),
            unit: n.unit.map(|u| names.unit(n.model, u)),
            offloaded: n.offloaded,
        }
    }
}

#[derive(Serialize)]
struct SavedJson<'a> {
    value: &'a str,
    bytes: u64,
    layer: Option<u32>,
    kind: &'static str,
    model: Option<&'a str>,
    alias_of: Option<&'a str>,
    offloaded: bool,
}

impl<'a> SavedJson<'a> {
    fn of(s: &SavedValue, names: &'a dyn PlanNames) -> Self {
        SavedJson {
            value: names.value(s.value),
            bytes: s.bytes,
            layer: s.layer,
            kind: s.kind.name(),
            model: s.model.map(|m| names.model(m)),
            alias_of: s.alias_of.map(|v| names.value(v)),
            offloaded: s.offloaded,
        }
    }
}

#[derive(Serialize)]
struct ReplayJson<'a> {
    model: &'a str,
    layer: u32,
    nodes: Each<'a, NodeId, &'a str>,
    before: &'a str,
    seconds: f64,
}

impl<'a> ReplayJson<'a> {
    fn of(r: &'a Replay, names: &'a dyn PlanNames) -> Self {
        ReplayJson {
            model: names.model(r.at.model),
            layer: r.at.layer,
            nodes: Each::new(&r.nodes, |&n| names.node(n)),
            before: names.node(r.before),
            seconds: r.seconds,
        }
    }
}

#[derive(Serialize)]
struct UnitJson<'a> {
    model: &'a str,
    unit: &'a str,
    kept_ops: u64,
    saved_bytes: u64,
    replay_time_avoided_s: f64,
    layers: &'a [UnitLayer],
}

impl<'a> UnitJson<'a> {
    fn of(u: &'a UnitSummary, names: &'a dyn PlanNames) -> Self {
        UnitJson {
            model: names.model(u.model),
            unit: names.unit(u.model, u.unit),
            kept_ops: u.kept_ops,
            saved_bytes: u.saved_bytes,
            replay_time_avoided_s: u.replay_time_avoided_s,
            layers: &u.layers,
        }
    }
}

#[derive(Serialize)]
struct MemoryJson<'a> {
    peak_bytes: Option<u64>,
    saved_bytes: u64,
    no_checkpoint_peak_bytes: Option<u64>,
    full_recompute_peak_bytes: Option<u64>,
    peak_stage: Option<&'static str>,
    peak_node: Option<&'a str>,
    parameter_bytes: u64,
    gradient_bytes: u64,
    device_total_bytes: Option<u64>,
    device_peak_phase: Option<&'static str>,
    device_parameter_bytes: Option<u64>,
    device_activation_bytes: Option<u64>,
    optimizer_state_bytes: Option<u64>,
    master_weight_bytes: Option<u64>,
    optimizer_step_bytes: Option<u64>,
    device_memory_bytes: Option<u64>,
    offloaded_bytes: u64,
    host_peak_bytes: u64,
    host_memory_bytes: u64,
    saved_on_device_bytes: u64,
}

impl<'a> MemoryJson<'a> {
    fn of(m: &Memory, names: &'a dyn PlanNames) -> Self {
        let d = m.device;
        MemoryJson {
            peak_bytes: m.peak_bytes,
            saved_bytes: m.saved_bytes,
            no_checkpoint_peak_bytes: m.no_checkpoint_peak_bytes,
            full_recompute_peak_bytes: m.full_recompute_peak_bytes,
            peak_stage: m.peak.map(|p| p.stage.name()),
            peak_node: m.peak.map(|p| names.node(p.node)),
            parameter_bytes: m.parameter_bytes,
            gradient_bytes: m.gradient_bytes,
            device_total_bytes: d.map(|d| d.total_bytes),
            device_peak_phase: d.map(|d| d.phase.name()),
            device_parameter_bytes: d.map(|d| d.parameter_bytes),
            device_activation_bytes: d.map(|d| d.activation_bytes),
            optimizer_state_bytes: d.map(|d| d.optimizer_state_bytes),
            master_weight_bytes: d.map(|d| d.master_weight_bytes),
            optimizer_step_bytes: d.map(|d| d.optimizer_step_bytes),
            device_memory_bytes: d.map(|d| d.memory_bytes),
            offloaded_bytes: m.offloaded_bytes,
            host_peak_bytes: m.host_peak_bytes,
            host_memory_bytes: m.host_memory_bytes,
            saved_on_device_bytes: m.saved_on_device_bytes,
        }
    }
}

#[derive(Serialize)]
struct DiagnosticJson<'a> {
    level: &'static str,
    code: &'static str,
    model: &'a str,
    unit: Option<&'a str>,
    message: &'a str,
    hint: &'a str,
}

impl<'a> DiagnosticJson<'a> {
    fn of(d: &'a Diagnostic, names: &'a dyn PlanNames) -> Self {
        DiagnosticJson {
            level: d.level.name(),
            code: d.code.name(),
            model: names.model(d.model),
            unit: d.unit.map(|u| names.unit(d.model, u)),
            message: &d.message,
            hint: &d.hint,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::decode;

    #[test]
    fn a_number_out_of_range_names_its_key_in_plain_words() {
        let json = b"{\n  \"nodes\": [\n    {\"name\": \"n\", \"layer\": 4294967296}\n  ]\n}";
        let error = decode(json).unwrap_err().to_string();
        assert_eq!(
            error,
            "not a valid JSON plan: `layer` must be a whole number in its range (a number or a \
             string of digits) at line 3 column 38"
        );
    }
}
