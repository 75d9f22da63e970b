//! The plan's JSON: the proto3 JSON of `plan.proto` with the proto field names as keys and
//! 64-bit integers as numbers, pretty-printed with a final newline. Any proto3 JSON parser reads
//! it (Python's `json_format.Parse` into the generated `Plan`, for one); this module reads it
//! through the same wire message as the `.pb` form, so both formats have one conversion.
//!
//! The writer streams the typed plan through serde, naming ids on the way: a million-node plan
//! is written without building its named form first.

use serde::{ser::SerializeSeq, Serialize, Serializer};

use super::{
    Config, Cost, Diagnostic, LayerKeep, Memory, NodeDecision, Plan, PlanNames, PlanReadError,
    Replay, SavedValue, UnitSummary,
};
use crate::wire::plan as pb;

/// The JSON text of `plan`, its ids named by `names`, as UTF-8 bytes. The buffer is sized
/// for the plan up front: growing a 120 MB text by doubling copies it again and again, into
/// fresh memory each time.
pub fn write(plan: &Plan, names: &dyn PlanNames) -> Vec<u8> {
    let mut text = Vec::with_capacity(capacity_for(plan));
    serde_json::to_writer_pretty(&mut text, &PlanJson { plan, names })
        .expect("a plan serialises to JSON: every map key is a string");
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
    serde_json::to_value(LayerKeepJson { layer_keep, names })
        .expect("layer choices serialise to JSON")
}

pub(super) fn decode(bytes: &[u8]) -> Result<pb::Plan, PlanReadError> {
    serde_json::from_slice(bytes).map_err(|e| PlanReadError::Json(e.to_string()))
}

struct PlanJson<'a> {
    plan: &'a Plan,
    names: &'a dyn PlanNames,
}

impl Serialize for PlanJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (p, names) = (self.plan, self.names);
        #[derive(Serialize)]
        struct Doc<'a> {
            planner_version: &'a str,
            graph: GraphJson<'a>,
            config: ConfigJson<'a>,
            joint: bool,
            nodes: Each<'a, NodeDecision>,
            saved: Each<'a, SavedValue>,
            replay: Each<'a, Replay>,
            units: Each<'a, UnitSummary>,
            memory: MemoryJson<'a>,
            cost: &'a Cost,
            diagnostics: Each<'a, Diagnostic>,
        }
        #[derive(Serialize)]
        struct GraphJson<'a> {
            name: &'a str,
            fingerprint: &'a str,
        }
        Doc {
            planner_version: &p.planner_version,
            graph: GraphJson {
                name: &p.graph.name,
                fingerprint: &p.graph.fingerprint,
            },
            config: ConfigJson {
                config: &p.config,
                names,
            },
            joint: p.joint,
            nodes: Each(&p.nodes, names),
            saved: Each(&p.saved, names),
            replay: Each(&p.replay, names),
            units: Each(&p.units, names),
            memory: MemoryJson {
                memory: &p.memory,
                names,
            },
            cost: &p.cost,
            diagnostics: Each(&p.diagnostics, names),
        }
        .serialize(s)
    }
}

/// A list of plan items, each written with the names.
struct Each<'a, T>(&'a [T], &'a dyn PlanNames);

/// How one plan item is written, given the names.
trait Named {
    fn write<S: Serializer>(&self, names: &dyn PlanNames, s: S) -> Result<S::Ok, S::Error>;
}

impl<T: Named> Serialize for Each<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for item in self.0 {
            seq.serialize_element(&One(item, self.1))?;
        }
        seq.end()
    }
}

struct One<'a, T>(&'a T, &'a dyn PlanNames);

impl<T: Named> Serialize for One<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.write(self.1, s)
    }
}

impl Named for NodeDecision {
    fn write<S: Serializer>(&self, names: &dyn PlanNames, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct NodeJson<'a> {
            name: &'a str,
            op: &'a str,
            model: &'a str,
            layer: Option<u32>,
            decision: &'static str,
            reason: &'static str,
            unit: Option<&'a str>,
        }
        NodeJson {
            name: names.node(self.node),
            op: names.op(self.node),
            model: names.model(self.model),
            layer: self.layer,
            decision: self.decision.name(),
            reason: self.reason.name(),
            unit: self.unit.map(|u| names.unit(self.model, u)),
        }
        .serialize(s)
    }
}

impl Named for SavedValue {
    fn write<S: Serializer>(&self, names: &dyn PlanNames, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct SavedJson<'a> {
            value: &'a str,
            bytes: u64,
            layer: Option<u32>,
            kind: &'static str,
            model: Option<&'a str>,
            alias_of: Option<&'a str>,
        }
        SavedJson {
            value: names.value(self.value),
            bytes: self.bytes,
            layer: self.layer,
            kind: self.kind.name(),
            model: self.model.map(|m| names.model(m)),
            alias_of: self.alias_of.map(|v| names.value(v)),
        }
        .serialize(s)
    }
}

impl Named for Replay {
    fn write<S: Serializer>(&self, names: &dyn PlanNames, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct ReplayJson<'a> {
            model: &'a str,
            layer: u32,
            nodes: NodeNames<'a>,
            before: &'a str,
            seconds: f64,
        }
        ReplayJson {
            model: names.model(self.at.model),
            layer: self.at.layer,
            nodes: NodeNames(&self.nodes, names),
            before: names.node(self.before),
            seconds: self.seconds,
        }
        .serialize(s)
    }
}

/// Node ids, written as their names.
struct NodeNames<'a>(&'a [crate::NodeId], &'a dyn PlanNames);

impl Serialize for NodeNames<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|&n| self.1.node(n)))
    }
}

impl Named for UnitSummary {
    fn write<S: Serializer>(&self, names: &dyn PlanNames, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct UnitJson<'a> {
            model: &'a str,
            unit: &'a str,
            kept_ops: u64,
            saved_bytes: u64,
            replay_time_avoided_s: f64,
            layers: Vec<UnitLayerJson>,
        }
        #[derive(Serialize)]
        struct UnitLayerJson {
            layer: u32,
            kept_ops: u64,
            saved_bytes: u64,
        }
        UnitJson {
            model: names.model(self.model),
            unit: names.unit(self.model, self.unit),
            kept_ops: self.kept_ops,
            saved_bytes: self.saved_bytes,
            replay_time_avoided_s: self.replay_time_avoided_s,
            layers: self
                .layers
                .iter()
                .map(|l| UnitLayerJson {
                    layer: l.layer,
                    kept_ops: l.kept_ops,
                    saved_bytes: l.saved_bytes,
                })
                .collect(),
        }
        .serialize(s)
    }
}

impl Named for Diagnostic {
    fn write<S: Serializer>(&self, names: &dyn PlanNames, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct DiagnosticJson<'a> {
            level: &'static str,
            code: &'static str,
            model: &'a str,
            unit: Option<&'a str>,
            message: &'a str,
            hint: &'a str,
        }
        DiagnosticJson {
            level: self.level.name(),
            code: self.code.name(),
            model: names.model(self.model),
            unit: self.unit.map(|u| names.unit(self.model, u)),
            message: &self.message,
            hint: &self.hint,
        }
        .serialize(s)
    }
}

struct ConfigJson<'a> {
    config: &'a Config,
    names: &'a dyn PlanNames,
}

impl Serialize for ConfigJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Doc<'a> {
            keep: Vec<String>,
            recompute_ratio: f64,
            collectives: &'static str,
            random_ops: &'static str,
            executor: &'static str,
            budget_bytes: Option<u64>,
            layer_keep: LayerKeepList<'a>,
        }
        let c = self.config;
        Doc {
            keep: c.keep.names(),
            recompute_ratio: c.recompute_ratio,
            collectives: c.collectives.name(),
            random_ops: c.random_ops.name(),
            executor: c.executor.name(),
            budget_bytes: c.budget_bytes,
            layer_keep: LayerKeepList(&c.layer_keep, self.names),
        }
        .serialize(s)
    }
}

/// `{"layer_keep": [...]}`: the choices object `plan --choices` reads.
struct LayerKeepJson<'a> {
    layer_keep: &'a [LayerKeep],
    names: &'a dyn PlanNames,
}

impl Serialize for LayerKeepJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        LayerKeepList(self.layer_keep, self.names).serialize(s)
    }
}

struct LayerKeepList<'a>(&'a [LayerKeep], &'a dyn PlanNames);

impl Serialize for LayerKeepList<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct LayerKeepItem<'a> {
            model: &'a str,
            layer: u32,
            keep: Vec<&'a str>,
        }
        let names = self.1;
        s.collect_seq(self.0.iter().map(|l| LayerKeepItem {
            model: names.model(l.at.model),
            layer: l.at.layer,
            keep: l.units.iter().map(|&u| names.unit(l.at.model, u)).collect(),
        }))
    }
}

struct MemoryJson<'a> {
    memory: &'a Memory,
    names: &'a dyn PlanNames,
}

impl Serialize for MemoryJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Doc<'a> {
            peak_bytes: Option<u64>,
            saved_bytes: u64,
            no_checkpoint_peak_bytes: Option<u64>,
            full_recompute_peak_bytes: Option<u64>,
            peak_stage: Option<&'static str>,
            peak_node: Option<&'a str>,
            parameter_bytes: u64,
            gradient_bytes: u64,
        }
        let m = self.memory;
        Doc {
            peak_bytes: m.peak_bytes,
            saved_bytes: m.saved_bytes,
            no_checkpoint_peak_bytes: m.no_checkpoint_peak_bytes,
            full_recompute_peak_bytes: m.full_recompute_peak_bytes,
            peak_stage: m.peak.map(|p| p.stage.name()),
            peak_node: m.peak.map(|p| self.names.node(p.node)),
            parameter_bytes: m.parameter_bytes,
            gradient_bytes: m.gradient_bytes,
        }
        .serialize(s)
    }
}
