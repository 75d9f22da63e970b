//! The plan's JSON: the proto3 JSON of `plan.proto` with the proto field names as keys and
//! 64-bit integers as numbers, pretty-printed with a final newline. Any proto3 JSON parser reads
//! it (Python's `json_format.Parse` into the generated `Plan`, for one); this module reads it
//! through the same wire message as the `.pb` form, so both formats have one conversion.
//!
//! The writer walks the typed plan and writes its text directly, naming ids on the way: a
//! million-node plan is 120 MB of JSON, written without building its named form first and
//! without a serializer's work per token. It writes exactly what `serde_json`'s pretty printer
//! writes of the same document (a test holds it to that).

use super::{
    Config, Cost, DeviceTotal, Diagnostic, LayerKeep, Memory, NodeDecision, Plan, PlanNames,
    PlanReadError, Replay, SavedValue, UnitSummary,
};
use crate::wire::plan as pb;

/// The JSON text of `plan`, its ids named by `names`, as UTF-8 bytes. The buffer is sized
/// for the plan up front: growing a 120 MB text by doubling copies it again and again, into
/// fresh memory each time.
pub fn write(plan: &Plan, names: &dyn PlanNames) -> Vec<u8> {
    let mut json = Pretty::with_capacity(capacity_for(plan));
    write_plan(&mut json, plan, names);
    let mut text = json.out;
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
    let mut json = Pretty::with_capacity(0);
    write_layer_keep(&mut json, layer_keep, names);
    serde_json::from_slice(&json.out).expect("the writer writes JSON")
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

fn write_plan(j: &mut Pretty, p: &Plan, names: &dyn PlanNames) {
    j.object(|j| {
        j.key("planner_version").str(&p.planner_version);
        j.key("graph").object(|j| {
            j.key("name").str(&p.graph.name);
            j.key("fingerprint").str(&p.graph.fingerprint);
        });
        write_config(j.key("config"), &p.config, names);
        j.key("joint").bool(p.joint);
        j.key("nodes")
            .array(&p.nodes, |j, node| write_node(j, node, names));
        j.key("saved")
            .array(&p.saved, |j, saved| write_saved(j, saved, names));
        j.key("replay")
            .array(&p.replay, |j, replay| write_replay(j, replay, names));
        j.key("units")
            .array(&p.units, |j, unit| write_unit(j, unit, names));
        write_memory(j.key("memory"), &p.memory, names);
        write_cost(j.key("cost"), &p.cost);
        j.key("diagnostics")
            .array(&p.diagnostics, |j, d| write_diagnostic(j, d, names));
    });
}

fn write_config(j: &mut Pretty, c: &Config, names: &dyn PlanNames) {
    j.object(|j| {
        j.key("keep").array(c.keep.names(), |j, unit| {
            j.str(&unit);
        });
        j.key("recompute_ratio").f64(c.recompute_ratio);
        j.key("collectives").str(c.collectives.name());
        j.key("random_ops").str(c.random_ops.name());
        j.key("executor").str(c.executor.name());
        j.key("budget_bytes").option(c.budget_bytes, Pretty::u64);
        write_layer_keep(j.key("layer_keep"), &c.layer_keep, names);
        j.key("fsdp").u64(c.training.fsdp.into());
        j.key("optimizer").str(c.training.optimizer.name());
        j.key("optimizer_state_dtype")
            .str(c.training.state_dtype.name());
        j.key("master_weights").bool(c.training.master_weights);
        j.key("offload").array(&c.offload.units, |j, unit| {
            j.str(unit);
        });
        j.key("offload_kinds").array(&c.offload.kinds, |j, kind| {
            j.str(kind.name());
        });
        j.key("offload_prefetch").u64(c.offload.prefetch.into());
    });
}

/// `[{"model", "layer", "keep"}, ...]`: the choices `plan --choices` reads.
fn write_layer_keep(j: &mut Pretty, layer_keep: &[LayerKeep], names: &dyn PlanNames) {
    j.array(layer_keep, |j, l| {
        j.object(|j| {
            j.key("model").str(names.model(l.at.model));
            j.key("layer").u64(l.at.layer.into());
            j.key("keep").array(&l.units, |j, &u| {
                j.str(names.unit(l.at.model, u));
            });
        });
    });
}

fn write_node(j: &mut Pretty, n: &NodeDecision, names: &dyn PlanNames) {
    j.object(|j| {
        j.key("name").str(names.node(n.node));
        j.key("op").str(names.op(n.node));
        j.key("model").str(names.model(n.model));
        j.key("layer").option(n.layer.map(u64::from), Pretty::u64);
        j.key("decision").str(n.decision.name());
        j.key("reason").str(n.reason.name());
        j.key("unit")
            .option(n.unit.map(|u| names.unit(n.model, u)), Pretty::str);
        j.key("offloaded").bool(n.offloaded);
    });
}

fn write_saved(j: &mut Pretty, s: &SavedValue, names: &dyn PlanNames) {
    j.object(|j| {
        j.key("value").str(names.value(s.value));
        j.key("bytes").u64(s.bytes);
        j.key("layer").option(s.layer.map(u64::from), Pretty::u64);
        j.key("kind").str(s.kind.name());
        j.key("model")
            .option(s.model.map(|m| names.model(m)), Pretty::str);
        j.key("alias_of")
            .option(s.alias_of.map(|v| names.value(v)), Pretty::str);
        j.key("offloaded").bool(s.offloaded);
    });
}

fn write_replay(j: &mut Pretty, r: &Replay, names: &dyn PlanNames) {
    j.object(|j| {
        j.key("model").str(names.model(r.at.model));
        j.key("layer").u64(r.at.layer.into());
        j.key("nodes").array(&r.nodes, |j, &n| {
            j.str(names.node(n));
        });
        j.key("before").str(names.node(r.before));
        j.key("seconds").f64(r.seconds);
    });
}

fn write_unit(j: &mut Pretty, u: &UnitSummary, names: &dyn PlanNames) {
    j.object(|j| {
        j.key("model").str(names.model(u.model));
        j.key("unit").str(names.unit(u.model, u.unit));
        j.key("kept_ops").u64(u.kept_ops);
        j.key("saved_bytes").u64(u.saved_bytes);
        j.key("replay_time_avoided_s").f64(u.replay_time_avoided_s);
        j.key("layers").array(&u.layers, |j, l| {
            j.object(|j| {
                j.key("layer").u64(l.layer.into());
                j.key("kept_ops").u64(l.kept_ops);
                j.key("saved_bytes").u64(l.saved_bytes);
            });
        });
    });
}

fn write_memory(j: &mut Pretty, m: &Memory, names: &dyn PlanNames) {
    j.object(|j| {
        j.key("peak_bytes").option(m.peak_bytes, Pretty::u64);
        j.key("saved_bytes").u64(m.saved_bytes);
        j.key("no_checkpoint_peak_bytes")
            .option(m.no_checkpoint_peak_bytes, Pretty::u64);
        j.key("full_recompute_peak_bytes")
            .option(m.full_recompute_peak_bytes, Pretty::u64);
        j.key("peak_stage")
            .option(m.peak.map(|p| p.stage.name()), Pretty::str);
        j.key("peak_node")
            .option(m.peak.map(|p| names.node(p.node)), Pretty::str);
        j.key("parameter_bytes").u64(m.parameter_bytes);
        j.key("gradient_bytes").u64(m.gradient_bytes);
        let d = m.device;
        let part = |f: fn(&DeviceTotal) -> u64| d.as_ref().map(f);
        j.key("device_total_bytes")
            .option(part(|d| d.total_bytes), Pretty::u64);
        j.key("device_peak_phase")
            .option(d.map(|d| d.phase.name()), Pretty::str);
        j.key("device_parameter_bytes")
            .option(part(|d| d.parameter_bytes), Pretty::u64);
        j.key("device_activation_bytes")
            .option(part(|d| d.activation_bytes), Pretty::u64);
        j.key("optimizer_state_bytes")
            .option(part(|d| d.optimizer_state_bytes), Pretty::u64);
        j.key("master_weight_bytes")
            .option(part(|d| d.master_weight_bytes), Pretty::u64);
        j.key("optimizer_step_bytes")
            .option(part(|d| d.optimizer_step_bytes), Pretty::u64);
        j.key("device_memory_bytes")
            .option(part(|d| d.memory_bytes), Pretty::u64);
        j.key("offloaded_bytes").u64(m.offloaded_bytes);
        j.key("host_peak_bytes").u64(m.host_peak_bytes);
        j.key("host_memory_bytes").u64(m.host_memory_bytes);
        j.key("saved_on_device_bytes").u64(m.saved_on_device_bytes);
    });
}

fn write_cost(j: &mut Pretty, c: &Cost) {
    j.object(|j| {
        j.key("replay_flops").u64(c.replay_flops);
        j.key("replay_bytes").u64(c.replay_bytes);
        j.key("replay_comm_bytes").u64(c.replay_comm_bytes);
        j.key("replay_time_s").f64(c.replay_time_s);
        j.key("full_recompute_replay_time_s")
            .f64(c.full_recompute_replay_time_s);
        j.key("forward_time_s").f64(c.forward_time_s);
        j.key("backward_time_s").f64(c.backward_time_s);
        j.key("step_time_s").f64(c.step_time_s);
        j.key("replay_host_syncs").u64(c.replay_host_syncs);
        j.key("transfer_time_s").f64(c.transfer_time_s);
        j.key("exposed_transfer_time_s")
            .f64(c.exposed_transfer_time_s);
        j.key("hw").str(&c.hw);
    });
}

fn write_diagnostic(j: &mut Pretty, d: &Diagnostic, names: &dyn PlanNames) {
    j.object(|j| {
        j.key("level").str(d.level.name());
        j.key("code").str(d.code.name());
        j.key("model").str(names.model(d.model));
        j.key("unit")
            .option(d.unit.map(|u| names.unit(d.model, u)), Pretty::str);
        j.key("message").str(&d.message);
        j.key("hint").str(&d.hint);
    });
}

/// Pretty-printed JSON text as `serde_json::to_writer_pretty` writes it: two spaces per level,
/// every member and element on a line of its own, `": "` after a key, `[]` and `{}` for empty
/// containers, strings escaped as `serde_json` escapes them, non-finite numbers as `null`.
struct Pretty {
    out: Vec<u8>,
    /// Open containers.
    depth: usize,
    /// Whether the innermost open container has no member yet.
    empty: bool,
}

impl Pretty {
    fn with_capacity(capacity: usize) -> Self {
        Pretty {
            out: Vec::with_capacity(capacity),
            depth: 0,
            empty: true,
        }
    }

    /// An object whose members `body` writes with [`Pretty::key`].
    fn object(&mut self, body: impl FnOnce(&mut Self)) {
        let outer = self.open(b'{');
        body(self);
        self.close(b'}', outer);
    }

    /// An array of `items`, each written by `item`.
    fn array<T>(&mut self, items: impl IntoIterator<Item = T>, mut item: impl FnMut(&mut Self, T)) {
        let outer = self.open(b'[');
        for element in items {
            self.next_member();
            item(self, element);
        }
        self.close(b']', outer);
    }

    /// The next member of the object being written: its key (a plain identifier, which needs
    /// no escaping); the value comes next.
    fn key(&mut self, key: &str) -> &mut Self {
        self.next_member();
        self.out.push(b'"');
        self.out.extend_from_slice(key.as_bytes());
        self.out.extend_from_slice(b"\": ");
        self
    }

    fn str(&mut self, text: &str) {
        self.out.push(b'"');
        let bytes = text.as_bytes();
        // Every byte is looked at (no early exit), which the compiler turns into wide
        // comparisons; nearly no name needs escaping.
        let plain = bytes
            .iter()
            .fold(true, |plain, &b| plain & !needs_escape(b));
        if !plain {
            for &b in bytes {
                match escape(b) {
                    None => self.out.push(b),
                    Some(b'u') => {
                        const HEX: &[u8; 16] = b"0123456789abcdef";
                        self.out.extend_from_slice(b"\\u00");
                        self.out.push(HEX[usize::from(b >> 4)]);
                        self.out.push(HEX[usize::from(b & 0xf)]);
                    }
                    Some(letter) => self.out.extend_from_slice(&[b'\\', letter]),
                }
            }
        } else {
            self.out.extend_from_slice(bytes);
        }
        self.out.push(b'"');
    }

    fn u64(&mut self, value: u64) {
        self.out
            .extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
    }

    /// A double as `serde_json` writes it (`null` when not finite).
    fn f64(&mut self, value: f64) {
        serde_json::to_writer(&mut self.out, &value).expect("a double writes to memory");
    }

    fn bool(&mut self, value: bool) {
        self.out
            .extend_from_slice(if value { b"true" } else { b"false" });
    }

    /// `value` written by `write`, or `null`.
    fn option<T>(&mut self, value: Option<T>, write: fn(&mut Self, T)) {
        match value {
            Some(value) => write(self, value),
            None => self.out.extend_from_slice(b"null"),
        }
    }

    /// Opens a container; returns whether the enclosing one was still empty.
    fn open(&mut self, bracket: u8) -> bool {
        self.out.push(bracket);
        self.depth += 1;
        std::mem::replace(&mut self.empty, true)
    }

    fn close(&mut self, bracket: u8, outer_empty: bool) {
        self.depth -= 1;
        if !self.empty {
            self.new_line();
        }
        self.out.push(bracket);
        self.empty = outer_empty;
    }

    fn next_member(&mut self) {
        if !self.empty {
            self.out.push(b',');
        }
        self.empty = false;
        self.new_line();
    }

    /// A line break and the indentation of the current depth, in one copy.
    fn new_line(&mut self) {
        const INDENTED: &[u8] =
            b"\n                                                                ";
        let width = 2 * self.depth;
        match INDENTED.get(..1 + width) {
            Some(line) => self.out.extend_from_slice(line),
            None => {
                self.out.push(b'\n');
                self.out.resize(self.out.len() + width, b' ');
            }
        }
    }
}

/// Whether JSON escapes byte `b` of a string.
fn needs_escape(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// How JSON escapes byte `b` of a string: `None` as itself, `Some(b'u')` as `\u00XX`, else as
/// a backslash and the letter (the quote, the backslash, and the five control characters with
/// short escapes).
fn escape(b: u8) -> Option<u8> {
    match b {
        b'"' => Some(b'"'),
        b'\\' => Some(b'\\'),
        0x08 => Some(b'b'),
        0x0c => Some(b'f'),
        b'\n' => Some(b'n'),
        b'\r' => Some(b'r'),
        b'\t' => Some(b't'),
        0..0x20 => Some(b'u'),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde::Serialize;

    use super::{decode, Pretty};

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

    #[derive(Serialize)]
    struct Doc {
        text: String,
        every_ascii: String,
        other_scripts: String,
        count: u64,
        largest: u64,
        numbers: Vec<f64>,
        yes: bool,
        none: Option<u64>,
        some: Option<String>,
        empty_list: Vec<u64>,
        empty_object: Empty,
        objects: Vec<Inner>,
        lists: Vec<Vec<String>>,
    }

    #[derive(Serialize)]
    struct Empty {}

    #[derive(Serialize)]
    struct Inner {
        layer: u64,
        empty: Vec<u64>,
    }

    /// Every kind of member the plan's JSON holds, written by the writer and by serde_json's
    /// pretty printer: the same text (every ASCII byte and other scripts in strings, doubles of
    /// every magnitude and the non-finite ones, empty and nested containers).
    #[test]
    fn the_writer_writes_what_serde_json_pretty_prints() {
        let doc = Doc {
            text: "aten.mm.default".to_owned(),
            every_ascii: (0u8..=0x7f).map(char::from).collect(),
            other_scripts: "é名\u{2028}\u{7f}".to_owned(),
            count: 7,
            largest: u64::MAX,
            numbers: vec![
                0.0,
                -0.0,
                1.0,
                0.1,
                1e-7,
                1.5e300,
                f64::MIN_POSITIVE,
                f64::NAN,
                f64::INFINITY,
            ],
            yes: true,
            none: None,
            some: Some("x".to_owned()),
            empty_list: Vec::new(),
            empty_object: Empty {},
            objects: vec![
                Inner {
                    layer: 0,
                    empty: Vec::new(),
                },
                Inner {
                    layer: 3,
                    empty: Vec::new(),
                },
            ],
            lists: vec![Vec::new(), vec!["a".to_owned(), "b".to_owned()]],
        };
        let mut j = Pretty::with_capacity(0);
        j.object(|j| {
            j.key("text").str(&doc.text);
            j.key("every_ascii").str(&doc.every_ascii);
            j.key("other_scripts").str(&doc.other_scripts);
            j.key("count").u64(doc.count);
            j.key("largest").u64(doc.largest);
            j.key("numbers").array(&doc.numbers, |j, &x| j.f64(x));
            j.key("yes").bool(doc.yes);
            j.key("none").option(doc.none, Pretty::u64);
            j.key("some").option(doc.some.as_deref(), Pretty::str);
            j.key("empty_list").array(&doc.empty_list, |j, &x| j.u64(x));
            j.key("empty_object").object(|_| {});
            j.key("objects").array(&doc.objects, |j, inner| {
                j.object(|j| {
                    j.key("layer").u64(inner.layer);
                    j.key("empty").array(&inner.empty, |j, &x| j.u64(x));
                });
            });
            j.key("lists").array(&doc.lists, |j, list| {
                j.array(list, |j, s| j.str(s));
            });
        });
        let expected = serde_json::to_string_pretty(&doc).unwrap();
        assert_eq!(String::from_utf8(j.out).unwrap(), expected);
    }
}
