//! One test per malformed graph: each must be rejected with a message naming the culprit.
//!
//! Every case starts from the same small valid graph and breaks exactly one thing, so a test
//! fails if the rule it names stops being enforced (the base graph itself must load).

use ir::{
    wire::graph::{self as pb, attribute::Value as AttrValue},
    Graph, ValidationError,
};

fn value(name: &str, dtype: pb::Dtype, shape: &[i64], role: pb::Role) -> pb::Value {
    pb::Value {
        name: name.to_owned(),
        dtype: dtype as i32,
        shape: shape.to_vec(),
        role: role as i32,
    }
}

fn node(name: &str, op: &str, inputs: &[&str], outputs: &[&str], phase: pb::Phase) -> pb::Node {
    pb::Node {
        name: name.to_owned(),
        op: op.to_owned(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        outputs: outputs.iter().map(|s| s.to_string()).collect(),
        phase: phase as i32,
        model: "main".to_owned(),
        layer: Some(0),
        ..Default::default()
    }
}

fn marker(name: &str, marker_name: &str, input: &str, output: &str) -> pb::Node {
    pb::Node {
        attributes: vec![pb::Attribute {
            name: "name".to_owned(),
            value: Some(AttrValue::Str(marker_name.to_owned())),
        }],
        ..node(name, ir::MARKER_OP, &[input], &[output], pb::Phase::Forward)
    }
}

/// x @ w between two markers, summed into a loss; backward computes w's gradient.
fn base() -> pb::Graph {
    use pb::{Dtype::*, Phase::*, Role::*};
    pb::Graph {
        name: "base".to_owned(),
        values: vec![
            value("x", Float32, &[4, 8], Input),
            value("w", Float32, &[8, 2], Parameter),
            value("x_m", Float32, &[4, 8], Activation),
            value("y", Float32, &[4, 2], Activation),
            value("y_m", Float32, &[4, 2], Activation),
            value("loss", Float32, &[], Loss),
            value("tangent", Float32, &[], Tangent),
            value("grad_y", Float32, &[4, 2], Gradient),
            value("x_t", Float32, &[8, 4], Activation),
            value("grad_w", Float32, &[8, 2], Gradient),
        ],
        nodes: vec![
            marker("begin", "mlp.begin", "x", "x_m"),
            node("mm", "aten.mm.default", &["x_m", "w"], &["y"], Forward),
            marker("end", "mlp.end", "y", "y_m"),
            node("sum", "aten.sum.default", &["y_m"], &["loss"], Forward),
            node(
                "expand",
                "aten.expand.default",
                &["tangent"],
                &["grad_y"],
                Backward,
            ),
            node("t", "aten.t.default", &["x_m"], &["x_t"], Backward),
            node(
                "mm_bwd",
                "aten.mm.default",
                &["x_t", "grad_y"],
                &["grad_w"],
                Backward,
            ),
        ],
        outputs: vec!["loss".to_owned(), "grad_w".to_owned()],
        models: vec![pb::Model {
            name: "main".to_owned(),
            parent: String::new(),
            num_layers: 1,
            units: vec![pb::UnitIntervals {
                unit: "SAVE_MLP".to_owned(),
                intervals: vec![pb::MarkerInterval {
                    begin: "mlp.begin".to_owned(),
                    end: "mlp.end".to_owned(),
                }],
            }],
        }],
        metadata: Some(pb::Metadata {
            exporter_version: "test".to_owned(),
            torch_version: "2.13.0".to_owned(),
            world_size: 1,
            rank: 0,
        }),
    }
}

fn node_mut<'a>(g: &'a mut pb::Graph, name: &str) -> &'a mut pb::Node {
    g.nodes
        .iter_mut()
        .find(|n| n.name == name)
        .expect("node of the base graph")
}

fn value_mut<'a>(g: &'a mut pb::Graph, name: &str) -> &'a mut pb::Value {
    g.values
        .iter_mut()
        .find(|v| v.name == name)
        .expect("value of the base graph")
}

/// Breaks the base graph with `edit` and checks the error, and that its message names `culprits`.
fn check_rejected(edit: impl FnOnce(&mut pb::Graph), expected: ValidationError, culprits: &[&str]) {
    let mut g = base();
    edit(&mut g);
    let err = Graph::from_wire(g).expect_err("the broken graph must be rejected");
    let message = err.to_string();
    assert_eq!(err, expected, "message: {message}");
    for culprit in culprits {
        assert!(
            message.contains(culprit),
            "`{message}` does not name `{culprit}`"
        );
    }
}

#[test]
fn the_base_graph_is_valid() {
    let g = Graph::from_wire(base()).expect("base graph loads");
    assert_eq!(g.nodes().len(), 7);
    let begin = g.nodes().values().next().unwrap();
    assert_eq!(begin.marker().map(|m| m.as_str()), Some("mlp.begin"));
}

/// Values and nodes convert in parallel batches: whichever worker meets a broken element
/// first, the error is the first broken element in file order.
#[test]
fn the_first_broken_element_is_reported_however_the_workers_race() {
    let mut g = base();
    // Thousands of values, every 97th unnamed from the 1000th on: broken elements in every
    // worker's share of the batch, the first of them in the first share.
    g.values.extend((0..6000).map(|i| {
        let name = match i {
            1000.. if i % 97 == 0 => String::new(),
            _ => format!("extra_{i}"),
        };
        value(&name, pb::Dtype::Float32, &[1], pb::Role::Input)
    }));
    let first = g.values.iter().position(|v| v.name.is_empty()).unwrap();
    let workers = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    for _ in 0..10 {
        let err = workers.install(|| Graph::from_wire(g.clone()));
        assert_eq!(
            err.expect_err("unnamed values"),
            ValidationError::UnnamedValue { index: first }
        );
    }
}

#[test]
fn a_graph_without_nodes_is_rejected() {
    check_rejected(|g| g.nodes.clear(), ValidationError::NoNodes, &["no nodes"]);
}

#[test]
fn duplicate_node_names_are_rejected() {
    check_rejected(
        |g| node_mut(g, "sum").name = "mm".to_owned(),
        ValidationError::DuplicateNode { name: "mm".into() },
        &["duplicate node name `mm`"],
    );
}

#[test]
fn duplicate_value_names_are_rejected() {
    check_rejected(
        |g| {
            g.values
                .push(value("y", pb::Dtype::Float32, &[1], pb::Role::Input))
        },
        ValidationError::DuplicateValue { name: "y".into() },
        &["`y`"],
    );
}

#[test]
fn python_releases_of_forward_values_after_a_forward_node_are_accepted() {
    let mut g = base();
    node_mut(&mut g, "sum").python_releases = vec!["y".to_owned(), "x".to_owned()];
    let graph = Graph::from_wire(g).expect("forward releases what forward made, or an input");
    let (_, sum) = graph
        .nodes()
        .iter()
        .find(|(_, n)| n.name.as_str() == "sum")
        .expect("node sum");
    assert_eq!(sum.python_releases().len(), 2);
}

#[test]
fn a_python_release_naming_no_value_is_rejected() {
    check_rejected(
        |g| node_mut(g, "sum").python_releases = vec!["nope".to_owned()],
        ValidationError::UnknownPythonRelease {
            node: "sum".into(),
            value: "nope".into(),
        },
        &["`sum`", "`nope`"],
    );
}

#[test]
fn a_python_release_before_its_value_is_made_or_outside_forward_is_rejected() {
    for (node, value) in [("mm", "loss"), ("sum", "grad_y"), ("t", "y")] {
        check_rejected(
            |g| node_mut(g, node).python_releases = vec![value.to_owned()],
            ValidationError::PythonReleaseOutsideForward {
                node: node.into(),
                value: value.into(),
            },
            &[&format!("`{node}`"), &format!("`{value}`")],
        );
    }
}

#[test]
fn an_input_naming_no_value_is_rejected() {
    check_rejected(
        |g| node_mut(g, "sum").inputs = vec!["nope".to_owned()],
        ValidationError::UnknownInput {
            node: "sum".into(),
            value: "nope".into(),
        },
        &["`sum`", "`nope`"],
    );
}

#[test]
fn an_output_naming_no_value_is_rejected() {
    check_rejected(
        |g| node_mut(g, "sum").outputs = vec!["ghost".to_owned()],
        ValidationError::UnknownOutput {
            node: "sum".into(),
            value: "ghost".into(),
        },
        &["`sum`", "`ghost`"],
    );
}

#[test]
fn a_value_produced_twice_is_rejected() {
    check_rejected(
        |g| node_mut(g, "sum").outputs.push("y".to_owned()),
        ValidationError::ProducedTwice {
            value: "y".into(),
            first: "mm".into(),
            second: "sum".into(),
        },
        &["`y`", "`mm`", "`sum`"],
    );
}

#[test]
fn producing_a_graph_input_is_rejected() {
    check_rejected(
        |g| node_mut(g, "sum").outputs.push("w".to_owned()),
        ValidationError::ProducesGraphInput {
            node: "sum".into(),
            value: "w".into(),
            role: "parameter",
        },
        &["`sum`", "`w`"],
    );
}

#[test]
fn a_cycle_is_rejected_naming_a_node_on_it() {
    // mm now reads y_m, which `end` makes from mm's own output: mm -> end -> mm.
    let mut g = base();
    node_mut(&mut g, "mm").inputs[0] = "y_m".to_owned();
    let err = Graph::from_wire(g).expect_err("cycle");
    match &err {
        ValidationError::Cycle { node } => assert!(["mm", "end"].contains(&node.as_str()), "{err}"),
        other => panic!("expected a cycle, got {other}"),
    }
    assert!(err
        .to_string()
        .starts_with("dependency cycle through node `"));
}

#[test]
fn a_node_reading_its_own_output_is_a_cycle() {
    check_rejected(
        |g| node_mut(g, "sum").inputs.push("loss".to_owned()),
        ValidationError::Cycle { node: "sum".into() },
        &["`sum`"],
    );
}

#[test]
fn nodes_out_of_execution_order_are_rejected() {
    check_rejected(
        |g| g.nodes.swap(1, 2),
        ValidationError::UsedBeforeProduced {
            node: "end".into(),
            value: "y".into(),
            producer: "mm".into(),
        },
        &["`end`", "`y`", "`mm`", "execution order"],
    );
}

#[test]
fn a_graph_output_that_is_not_declared_is_rejected() {
    check_rejected(
        |g| g.outputs.push("grad_x".to_owned()),
        ValidationError::UnknownGraphOutput {
            value: "grad_x".into(),
        },
        &["`grad_x`"],
    );
}

#[test]
fn a_graph_output_never_produced_is_rejected() {
    check_rejected(
        |g| {
            g.values.push(value(
                "grad_x",
                pb::Dtype::Float32,
                &[4, 8],
                pb::Role::Gradient,
            ));
            g.outputs.push("grad_x".to_owned());
        },
        ValidationError::NeverProduced {
            value: "grad_x".into(),
            role: "gradient",
        },
        &["`grad_x`", "never produced"],
    );
}

#[test]
fn an_unknown_dtype_is_rejected() {
    check_rejected(
        |g| value_mut(g, "y").dtype = 99,
        ValidationError::UnknownDtype {
            value: "y".into(),
            code: 99,
        },
        &["`y`", "99"],
    );
}

#[test]
fn an_unspecified_dtype_is_rejected() {
    check_rejected(
        |g| value_mut(g, "y").dtype = 0,
        ValidationError::UnspecifiedDtype { value: "y".into() },
        &["`y`"],
    );
}

#[test]
fn an_unspecified_role_is_rejected() {
    check_rejected(
        |g| value_mut(g, "x").role = 0,
        ValidationError::UnspecifiedRole { value: "x".into() },
        &["`x`"],
    );
}

#[test]
fn a_negative_dimension_is_rejected() {
    check_rejected(
        |g| value_mut(g, "y").shape = vec![4, -1],
        ValidationError::NegativeDim {
            value: "y".into(),
            dim: 1,
            size: -1,
        },
        &["`y`", "-1", "dimension 1"],
    );
}

#[test]
fn a_shape_whose_bytes_overflow_is_rejected() {
    let shape = vec![1 << 31, 1 << 31, 4];
    check_rejected(
        |g| value_mut(g, "y").shape = shape.clone(),
        ValidationError::ShapeOverflow {
            value: "y".into(),
            shape: shape.clone(),
        },
        &["`y`", "overflows"],
    );
}

#[test]
fn a_shape_that_fits_exactly_is_accepted() {
    let mut g = base();
    // 2^61 float32 elements = 2^63 bytes: large but representable.
    value_mut(&mut g, "x").shape = vec![1 << 31, 1 << 30];
    assert!(Graph::from_wire(g).is_ok());
}

#[test]
fn a_marker_without_a_name_is_rejected() {
    check_rejected(
        |g| node_mut(g, "begin").attributes.clear(),
        ValidationError::UnnamedMarker {
            node: "begin".into(),
        },
        &["`begin`"],
    );
}

#[test]
fn a_marker_with_an_empty_name_is_rejected() {
    check_rejected(
        |g| node_mut(g, "end").attributes[0].value = Some(AttrValue::Str(String::new())),
        ValidationError::UnnamedMarker { node: "end".into() },
        &["`end`"],
    );
}

#[test]
fn a_node_referencing_an_undeclared_model_is_rejected() {
    check_rejected(
        |g| node_mut(g, "mm").model = "mtp".to_owned(),
        ValidationError::UndeclaredModel {
            node: "mm".into(),
            model: "mtp".into(),
        },
        &["`mm`", "`mtp`"],
    );
}

#[test]
fn a_layer_beyond_the_model_is_rejected() {
    check_rejected(
        |g| node_mut(g, "mm").layer = Some(3),
        ValidationError::LayerOutOfRange {
            node: "mm".into(),
            layer: 3,
            model: "main".into(),
            num_layers: 1,
        },
        &["`mm`", "layer 3", "`main`"],
    );
}

#[test]
fn a_node_without_phase_is_rejected() {
    check_rejected(
        |g| node_mut(g, "mm").phase = 0,
        ValidationError::UnspecifiedPhase { node: "mm".into() },
        &["`mm`"],
    );
}

#[test]
fn a_schema_fact_pointing_past_the_inputs_is_rejected() {
    check_rejected(
        |g| {
            node_mut(g, "mm").schema = Some(pb::SchemaFacts {
                mutates: vec![5],
                ..Default::default()
            })
        },
        ValidationError::SchemaPosition {
            node: "mm".into(),
            fact: "mutates",
            position: 5,
            inputs: 2,
        },
        &["`mm`", "position 5"],
    );
}

#[test]
fn an_attribute_without_value_is_rejected() {
    check_rejected(
        |g| {
            node_mut(g, "sum").attributes.push(pb::Attribute {
                name: "dim".to_owned(),
                value: None,
            })
        },
        ValidationError::EmptyAttribute {
            node: "sum".into(),
            attribute: "dim".into(),
        },
        &["`sum`", "`dim`"],
    );
}

#[test]
fn a_nested_model_with_an_undeclared_parent_is_rejected() {
    check_rejected(
        |g| g.models[0].parent = "outer".to_owned(),
        ValidationError::UndeclaredParent {
            model: "main".into(),
            parent: "outer".into(),
        },
        &["`main`", "`outer`"],
    );
}

#[test]
fn a_model_nested_inside_itself_is_rejected() {
    check_rejected(
        |g| g.models[0].parent = "main".to_owned(),
        ValidationError::ParentCycle {
            model: "main".into(),
        },
        &["`main`"],
    );
}

#[test]
fn a_unit_interval_with_an_empty_marker_is_rejected() {
    check_rejected(
        |g| g.models[0].units[0].intervals[0].end = String::new(),
        ValidationError::EmptyIntervalMarker {
            model: "main".into(),
            unit: "SAVE_MLP".into(),
            side: "end",
        },
        &["`main`", "`SAVE_MLP`", "end"],
    );
}

#[test]
fn a_unit_declared_twice_is_rejected() {
    check_rejected(
        |g| {
            let unit = g.models[0].units[0].clone();
            g.models[0].units.push(unit);
        },
        ValidationError::DuplicateUnit {
            model: "main".into(),
            unit: "SAVE_MLP".into(),
        },
        &["`SAVE_MLP`"],
    );
}

#[test]
fn schema_facts_merge_with_the_op_knowledge_base() {
    let mut g = base();
    node_mut(&mut g, "sum").schema = Some(pb::SchemaFacts {
        random: true,
        collective: pb::CollectiveKind::Functional as i32,
        ..Default::default()
    });
    let g = Graph::from_wire(g).expect("valid");
    let by_name = |name: &str| g.nodes().values().find(|n| n.name == name).unwrap();
    // From the exporter's facts:
    assert!(by_name("sum").effects.random);
    assert_eq!(
        by_name("sum").effects.collective,
        Some(ir::ops::CollectiveKind::Functional)
    );
    // From the knowledge base alone: `aten.t` is a view of its input.
    assert_eq!(by_name("t").effects.view_of, Some(0));
    assert!(!by_name("mm").effects.is_mutable());
}

#[test]
fn consumers_and_producers_agree_with_the_nodes() {
    let g = Graph::from_wire(base()).expect("valid");
    for (id, node) in g.nodes().iter() {
        for &v in &node.inputs {
            assert!(g.consumers(v).contains(&id));
            if let Some(p) = g.producer(v) {
                assert!(p < id);
                assert!(g.successors(p).contains(&id));
            }
        }
        for &v in &node.outputs {
            assert_eq!(g.producer(v), Some(id));
        }
    }
}

/// A node reading one value twice (`mm(x, x)`) is one consumer of it, listed once, and the
/// consumers of the values around it are unaffected.
#[test]
fn a_node_reading_a_value_twice_is_listed_once_among_its_consumers() {
    let mut g = base();
    node_mut(&mut g, "mm").inputs = vec!["x_m".to_owned(), "x_m".to_owned()];
    let g = Graph::from_wire(g).expect("valid");
    let consumers = |value: &str| -> Vec<&str> {
        let (id, _) = g.values().iter().find(|(_, v)| v.name == value).unwrap();
        g.consumers(id)
            .iter()
            .map(|&n| g.node(n).name.as_str())
            .collect()
    };
    assert_eq!(consumers("x_m"), ["mm", "t"]);
    assert_eq!(consumers("x"), ["begin"]);
    assert_eq!(consumers("w"), Vec::<&str>::new());
    assert_eq!(consumers("grad_y"), ["mm_bwd"]);
}

/// `base` with `det`, the `detach` of a saved output that AOTAutograd puts right after its
/// producer, in forward, as a backward node, and `use_det`, a late backward node reading it.
fn with_detach_in_forward() -> pb::Graph {
    let mut g = base();
    for name in ["y_det", "late"] {
        g.values
            .push(value(name, pb::Dtype::Float32, &[4, 2], pb::Role::Gradient));
    }
    g.nodes.insert(
        2,
        node(
            "det",
            "aten.detach.default",
            &["y"],
            &["y_det"],
            pb::Phase::Backward,
        ),
    );
    g.nodes.push(node(
        "use_det",
        "aten.mul.Tensor",
        &["y_det", "grad_y"],
        &["late"],
        pb::Phase::Backward,
    ));
    g
}

/// The names of `g`'s backward nodes in the order they run.
fn backward_names(g: &Graph) -> Vec<&str> {
    g.backward_order()
        .iter()
        .map(|&id| g.node(id).name.as_str())
        .collect()
}

#[test]
fn backward_nodes_placed_in_forward_run_just_before_their_first_backward_use() {
    let g = Graph::from_wire(with_detach_in_forward()).expect("valid");
    assert_eq!(
        backward_names(&g),
        ["expand", "t", "mm_bwd", "det", "use_det"]
    );
}

#[test]
fn a_backward_node_placed_in_forward_runs_before_every_backward_node_that_reads_it() {
    // `det2` reads `det`'s output and no later backward node reads `det2`'s: `det2` runs
    // first, so `det` must run before it although `use_det` would have it run later.
    let mut g = with_detach_in_forward();
    g.values.push(value(
        "y_det2",
        pb::Dtype::Float32,
        &[4, 2],
        pb::Role::Gradient,
    ));
    g.nodes.insert(
        3,
        node(
            "det2",
            "aten.detach.default",
            &["y_det"],
            &["y_det2"],
            pb::Phase::Backward,
        ),
    );
    let g = Graph::from_wire(g).expect("valid");
    assert_eq!(
        backward_names(&g),
        ["det", "det2", "expand", "t", "mm_bwd", "use_det"]
    );
}

#[test]
fn a_forward_node_reading_a_backward_result_is_refused_naming_both() {
    let mut g = base();
    // `t` (backward) makes `x_t`; a forward node placed after it reads it.
    g.values.push(value(
        "z",
        pb::Dtype::Float32,
        &[8, 4],
        pb::Role::Activation,
    ));
    g.nodes.push(node(
        "late_fwd",
        "aten.sin.default",
        &["x_t"],
        &["z"],
        pb::Phase::Forward,
    ));
    let error = Graph::from_wire(g).unwrap_err().to_string();
    assert!(
        error.contains("forward node `late_fwd` reads `x_t`, which backward node `t` produces"),
        "{error}"
    );
}
