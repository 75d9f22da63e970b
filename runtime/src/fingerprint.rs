//! What ranks compare before their first collective: the graph's structure and the plan.
//!
//! Ranks of one expert-parallel job run graphs that differ in tensor contents and may differ in
//! per-rank sizes (uneven all-to-all splits), but never in their ops and wiring: the structure
//! fingerprint hashes node names, ops, phases and the names of their inputs and outputs, and
//! value names, dtypes and roles, but no shapes and no attributes. The plan fingerprint hashes
//! its configuration, every decision, the saved set and the replays, by name.

use ir::{plan::Plan, Graph};

/// Appends `text` and a separator that no name holds.
fn field(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(text.as_bytes());
    out.push(0);
}

/// The structure fingerprint of `graph` (32 hex digits).
pub fn structure(graph: &Graph) -> String {
    let mut bytes = Vec::new();
    for value in graph.values().values() {
        field(&mut bytes, &value.name);
        field(&mut bytes, value.dtype.name());
        field(&mut bytes, value.role.name());
    }
    for node in graph.nodes().values() {
        field(&mut bytes, &node.name);
        field(&mut bytes, &node.op);
        field(&mut bytes, node.phase.name());
        for &v in node.inputs.iter().chain(&node.outputs) {
            field(&mut bytes, &graph.value(v).name);
        }
        bytes.push(1);
    }
    for &v in graph.outputs() {
        field(&mut bytes, &graph.value(v).name);
    }
    ir::fingerprint(&bytes)
}

/// The fingerprint of `plan` for `graph` (32 hex digits).
pub fn plan(plan: &Plan, graph: &Graph) -> String {
    let mut bytes = Vec::new();
    for keep in plan.config.keep.names() {
        field(&mut bytes, &keep);
    }
    field(&mut bytes, &plan.config.recompute_ratio.to_string());
    field(&mut bytes, plan.config.collectives.name());
    for d in &plan.nodes {
        field(&mut bytes, &graph.node(d.node).name);
        field(&mut bytes, d.decision.name());
    }
    for s in &plan.saved {
        field(&mut bytes, &graph.value(s.value).name);
    }
    for r in &plan.replay {
        field(&mut bytes, &graph.node(r.before).name);
        for &n in &r.nodes {
            field(&mut bytes, &graph.node(n).name);
        }
        bytes.push(1);
    }
    ir::fingerprint(&bytes)
}
