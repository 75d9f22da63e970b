//! `planner diff OLD NEW`: per-node decision changes between two plans, so CI can gate on a
//! plan not drifting.

use std::{collections::BTreeMap, fmt::Write as _, fs, path::Path};

use crate::{
    plan::{NodeDoc, Plan},
    render,
};

/// Reads a plan written by `planner plan --format json|pb`, by extension.
pub fn read_plan(path: &Path) -> Result<Plan, String> {
    let bytes = fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let plan = match path.extension().and_then(|e| e.to_str()) {
        Some("json") => serde_json::from_slice(&bytes).map_err(|e| e.to_string()),
        Some("pb") => render::from_protobuf(&bytes),
        _ => Err("unknown plan format: expected a `.json` or `.pb` plan".to_owned()),
    };
    plan.map_err(|e| format!("{}: {e}", path.display()))
}

/// One line per forward node whose decision, reason or unit differs, or that only one plan
/// has; empty when the plans decide alike.
pub fn diff(old: &Plan, new: &Plan) -> Vec<String> {
    let old_nodes: BTreeMap<&str, &NodeDoc> =
        old.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let new_nodes: BTreeMap<&str, &NodeDoc> =
        new.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut lines = Vec::new();
    for (name, o) in &old_nodes {
        match new_nodes.get(name) {
            None => lines.push(format!("- {name}: {} (only in the old plan)", describe(o))),
            Some(n) if describe(o) != describe(n) => lines.push(format!(
                "~ {name} ({}): {} -> {}",
                o.op,
                describe(o),
                describe(n)
            )),
            Some(_) => {}
        }
    }
    for (name, n) in &new_nodes {
        if !old_nodes.contains_key(name) {
            lines.push(format!("+ {name}: {} (only in the new plan)", describe(n)));
        }
    }
    lines
}

fn describe(n: &NodeDoc) -> String {
    let mut s = format!("{} ({}", n.decision, n.reason);
    if let Some(unit) = &n.unit {
        let _ = write!(s, ", {unit}");
    }
    s.push(')');
    s
}

/// The report printed by `planner diff`: a header naming both graphs, then the changes.
pub fn report(old: &Plan, new: &Plan, changes: &[String]) -> String {
    let mut out = String::new();
    if old.graph.fingerprint != new.graph.fingerprint {
        let _ = writeln!(
            out,
            "note: the plans are for different graphs ({} {} vs {} {})",
            old.graph.name, old.graph.fingerprint, new.graph.name, new.graph.fingerprint
        );
    }
    if changes.is_empty() {
        let _ = writeln!(
            out,
            "no decision changes ({} forward nodes)",
            old.nodes.len()
        );
    } else {
        let _ = writeln!(out, "{} decision changes:", changes.len());
        for line in changes {
            let _ = writeln!(out, "{line}");
        }
    }
    out
}
