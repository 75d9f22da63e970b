//! `planner diff OLD NEW`: per-node changes between two plans, so CI can gate on a plan not
//! drifting. Nodes are matched by name, so the plans may be for different exports of a model.
//!
//! A change of decision (save / recompute / no-checkpoint), or a node only one plan has, is a
//! decision change; a node that keeps its decision but for another reason or unit is a
//! reason-only change. Only decision changes fail the gate unless it is strict.

use std::{collections::BTreeMap, fmt::Write as _};

use ir::plan::{NameTable, NodeDecision, Plan, PlanNames};

/// A plan read from a file, with the names its ids stand for.
pub struct PlanFile {
    pub plan: Plan,
    pub names: NameTable,
}

/// What differs between two plans.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Nodes whose decision differs, or that only one plan has.
    pub decisions: Vec<String>,
    /// Nodes with the same decision for another reason or unit.
    pub reasons: Vec<String>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.decisions.is_empty() && self.reasons.is_empty()
    }
}

/// One node's verdict, in names.
#[derive(PartialEq, Eq)]
struct Verdict<'a> {
    op: &'a str,
    decision: &'static str,
    reason: &'static str,
    unit: Option<&'a str>,
}

impl std::fmt::Display for Verdict<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}", self.decision, self.reason)?;
        if let Some(unit) = self.unit {
            write!(f, ", {unit}")?;
        }
        f.write_str(")")
    }
}

fn verdicts(file: &PlanFile) -> BTreeMap<&str, Verdict<'_>> {
    let names = &file.names;
    file.plan
        .nodes
        .iter()
        .map(|n: &NodeDecision| {
            let verdict = Verdict {
                op: names.op(n.node),
                decision: n.decision.name(),
                reason: n.reason.name(),
                unit: n.unit.map(|u| names.unit(n.model, u)),
            };
            (names.node(n.node), verdict)
        })
        .collect()
}

/// The changes from `old` to `new`, one line each, in node-name order.
pub fn diff(old: &PlanFile, new: &PlanFile) -> Changes {
    let (old_nodes, new_nodes) = (verdicts(old), verdicts(new));
    let mut changes = Changes::default();
    for (name, o) in &old_nodes {
        match new_nodes.get(name) {
            None => changes
                .decisions
                .push(format!("- {name}: {o} (only in the old plan)")),
            Some(n) if o.decision != n.decision => changes
                .decisions
                .push(format!("~ {name} ({}): {o} -> {n}", o.op)),
            Some(n) if o != n => changes
                .reasons
                .push(format!("~ {name} ({}): {o} -> {n}", o.op)),
            Some(_) => {}
        }
    }
    for (name, n) in &new_nodes {
        if !old_nodes.contains_key(name) {
            changes
                .decisions
                .push(format!("+ {name}: {n} (only in the new plan)"));
        }
    }
    changes
}

/// The report printed by `planner diff`: a header naming both graphs, then the changes.
pub fn report(old: &Plan, new: &Plan, changes: &Changes) -> String {
    let mut out = String::new();
    if old.graph.fingerprint != new.graph.fingerprint {
        let _ = writeln!(
            out,
            "note: the plans are for different graphs ({} {} vs {} {})",
            old.graph.name, old.graph.fingerprint, new.graph.name, new.graph.fingerprint
        );
    }
    if changes.is_empty() {
        let _ = writeln!(out, "no changes ({} forward nodes)", old.nodes.len());
        return out;
    }
    let _ = writeln!(out, "{} decision changes", changes.decisions.len());
    for line in &changes.decisions {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "{} reason-only changes (same decision, other reason or unit)",
        changes.reasons.len()
    );
    for line in &changes.reasons {
        let _ = writeln!(out, "{line}");
    }
    out
}
