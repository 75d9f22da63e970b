//! Replays of layers whose tensors are written in place through aliases made outside the
//! replay (by an op of no layer, or of another layer). Such an alias is the resident forward
//! tensor, even when the replay makes its storage's root again: the graph executor keeps the
//! replay off it, and an eager recompute, which re-runs the whole prefix of its layer, reports
//! that it would write the resident tensor again or read it after forward wrote it. Neither may
//! end in the partition verifier's internal error (the fuzzer's `plan_graph` finding).

use ir::{
    plan::{Executor, Keep},
    wire::plan::{Diagnostic, Plan},
    Graph,
};
use planner::{config::PlanConfig, cost::HwProfile, plan::plan};
use testkit::Builder;

/// Whole-layer recompute under `executor`, in the plan's named form.
fn plan_under(graph: &Graph, executor: Executor) -> Plan {
    let config = PlanConfig {
        keep: Keep::Nothing,
        executor,
        ..PlanConfig::default()
    };
    let typed = plan(graph, &config, &HwProfile::default())
        .unwrap_or_else(|e| panic!("{executor:?} executor: {e}"));
    ir::plan::wire::to_wire(&typed, graph)
}

fn errors(plan: &Plan) -> Vec<&Diagnostic> {
    plan.diagnostics
        .iter()
        .filter(|d| d.level == "error")
        .collect()
}

/// The one error of an eager plan: its recompute does not reproduce forward.
fn eager_unfaithful(graph: &Graph) -> String {
    let eager = plan_under(graph, Executor::Eager);
    match errors(&eager).as_slice() {
        [d] if d.code == "eager-replay-unfaithful" => d.message.clone(),
        other => panic!("expected one eager-replay-unfaithful error, got {other:?}"),
    }
}

#[test]
fn eager_replay_writing_an_alias_made_outside_it_is_reported_not_an_internal_error() {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1: replayed, a fresh storage
    b.layer(None);
    let alias = b.node("aten.add_.Tensor", &[&a, &x]).1; // n2: no layer, writes `a`
    b.layer(Some(0));
    let written = b.node("aten.add_.Tensor", &[&alias, &x]).1; // n3: writes that alias
    b.layer(None);
    b.backward_through("tangent", &[&written]);
    let graph = b.build();

    let graph_plan = plan_under(&graph, Executor::Graph);
    assert!(
        errors(&graph_plan).is_empty(),
        "{:?}",
        graph_plan.diagnostics
    );
    let message = eager_unfaithful(&graph);
    assert!(
        message.contains("re-runs `n3`") && message.contains(&format!("writes `{alias}`")),
        "{message}"
    );
}

#[test]
fn eager_replay_reading_an_alias_that_forward_writes_later_is_reported_not_an_internal_error() {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1: replayed, a fresh storage
    b.layer(None);
    let alias = b.node("aten.add_.Tensor", &[&a, &x]).1; // n2: no layer, writes `a`
    b.layer(Some(0));
    let read = b.op(&alias); // n3: reads the alias
    b.layer(None);
    b.node("aten.add_.Tensor", &[&a, &x]); // n4: writes it again after that read
    b.backward_through("tangent", &[&read]);
    let graph = b.build();

    let graph_plan = plan_under(&graph, Executor::Graph);
    assert!(
        errors(&graph_plan).is_empty(),
        "{:?}",
        graph_plan.diagnostics
    );
    let message = eager_unfaithful(&graph);
    assert!(
        message.contains("re-runs `n3`")
            && message.contains(&format!(
                "reads `{alias}` after forward wrote it in place (`n4`)"
            )),
        "{message}"
    );
}

#[test]
fn eager_replay_writing_through_a_view_another_layer_made_is_reported_not_an_internal_error() {
    // Layer 1 takes a view of layer 0's tensor (saved as its input); layer 0 then writes the
    // tensor through that view.
    let mut b = Builder::new(2, &[]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1
    b.layer(Some(1));
    let view = b.node("aten.view.default", &[&a]).1; // n2
    b.layer(Some(0));
    let written = b.node("aten.add_.Tensor", &[&view, &x]).1; // n3
    b.layer(None);
    b.backward_through("tangent", &[&written, &view]);
    let graph = b.build();

    let graph_plan = plan_under(&graph, Executor::Graph);
    assert!(
        errors(&graph_plan).is_empty(),
        "{:?}",
        graph_plan.diagnostics
    );
    let message = eager_unfaithful(&graph);
    assert!(
        message.contains("re-runs `n3`") && message.contains(&format!("writes `{view}`")),
        "{message}"
    );
}

#[test]
fn an_op_whose_resident_second_output_is_written_in_place_is_saved_not_replayed() {
    // `var_mean` makes two tensors; backward needs the first. The second stays resident (an op
    // outside the layer reads it) and is written in place, so its writer cannot replay: a
    // replay of `var_mean` would make the second again without that write, and a replayed
    // reader of it would read that copy. The first output is saved instead.
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    b.layer(Some(0));
    let (stats, mean) = (b.node("aten.var_mean.correction", &[&x]), "mean".to_owned());
    b.node("aten.add_.Tensor", &[&mean, &x]); // n2 writes the second output
    let read = b.op(&mean); // n3 reads it written
    b.layer(None);
    b.op(&mean); // n4: outside the layer, so `mean` is saved as a layer input
    b.backward_through("tangent", &[&stats.1, &read]);
    let mut wire = b.wire();
    let mut second = wire.values[1].clone();
    second.name = mean.clone();
    wire.values.push(second);
    let producer = wire.nodes.iter_mut().find(|n| n.name == stats.0).unwrap();
    producer.outputs.push(mean.clone());
    let graph = Graph::from_wire(wire).expect("valid");

    let plan = plan_under(&graph, Executor::Graph);
    assert!(errors(&plan).is_empty(), "{:?}", plan.diagnostics);
    let replayed: Vec<&str> = plan
        .replay
        .iter()
        .flat_map(|r| &r.nodes)
        .map(String::as_str)
        .collect();
    assert_eq!(replayed, ["n3"]);
    let saved = |v: &str| {
        plan.saved
            .iter()
            .find(|s| s.value == v)
            .map(|s| s.kind.as_str())
    };
    assert_eq!(saved(&stats.1), Some("written-unreplayably"));
    assert_eq!(saved(&mean), Some("layer-input"));
}

#[test]
fn a_replayed_read_of_an_alias_saved_for_a_later_layer_and_written_after_it_is_saved() {
    // Layer 0 writes `a` in place twice; layer 1 reads the first write's result, an alias of
    // `a` saved as layer 1's input, before the second write. The saved alias holds the second
    // write in backward, so layer 1's reader cannot replay: its output is saved.
    let mut b = Builder::new(2, &[]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1
    let first = b.node("aten.add_.Tensor", &[&a, &x]).1; // n2
    b.layer(Some(1));
    let read = b.op(&first); // n3 reads the alias
    b.layer(Some(0));
    b.node("aten.add_.Tensor", &[&a, &x]); // n4 writes it again
    b.layer(None);
    b.backward_through("tangent", &[&read]);
    let graph = b.build();

    let plan = plan_under(&graph, Executor::Graph);
    assert!(errors(&plan).is_empty(), "{:?}", plan.diagnostics);
    let kind = plan
        .saved
        .iter()
        .find(|s| s.value == read)
        .map(|s| s.kind.as_str());
    assert_eq!(kind, Some("reads-overwritten"));
}
