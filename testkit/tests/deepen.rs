//! The deep-graph generator repeats a layer into a graph that still validates, with the node
//! count growing by one layer's worth per copy.

use std::path::Path;

use ir::{io, Graph, Phase};
use testkit::deepen;

fn fixture() -> ir::wire::graph::Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/two_layer_moe.pb");
    io::read_wire(&path).expect("fixture reads")
}

#[test]
fn repeated_layers_validate_and_scale_linearly() {
    let wire = fixture();
    let base = Graph::from_wire(wire.clone()).unwrap();
    let per_layer = base.nodes().values().filter(|n| n.layer == Some(0)).count();
    for layers in [1u32, 2, 7, 61] {
        let deep = Graph::from_wire(deepen(&wire, "main", 0, layers).unwrap())
            .unwrap_or_else(|e| panic!("{layers} layers: {e}"));
        assert_eq!(
            deep.nodes().len(),
            base.nodes().len() + per_layer * layers as usize - 2 * per_layer,
            "{layers} layers"
        );
        let model = deep.model_by_name("main").unwrap();
        assert_eq!(deep.model(model).num_layers, layers);
        let last = deep
            .nodes()
            .values()
            .filter(|n| n.layer == Some(layers - 1));
        assert!(last.filter(|n| n.phase == Phase::Backward).count() > 0);
        // The template layer's parameter gradients, once per copy.
        let grads_of = |layer| {
            base.outputs()
                .iter()
                .filter(|&&v| {
                    base.producer(v)
                        .is_some_and(|p| base.node(p).layer == Some(layer))
                })
                .count()
        };
        let (template, second) = (grads_of(0), grads_of(1));
        assert!(template > 0);
        assert_eq!(
            deep.outputs().len(),
            base.outputs().len() - template - second + template * layers as usize
        );
    }
}

#[test]
fn differing_layers_are_refused() {
    let mut wire = fixture();
    let victim = wire
        .nodes
        .iter_mut()
        .find(|n| n.layer == Some(1) && n.op == "aten.mm.default")
        .unwrap();
    victim.op = "aten.bmm.default".to_owned();
    let err = deepen(&wire, "main", 0, 4).unwrap_err();
    assert!(err.to_string().contains("differ"), "{err}");
}

#[test]
fn exported_graphs_deepen_too() {
    // AOTAutograd graphs: saved-output `detach` nodes sit in forward, and autograd's
    // gradient-accumulation adds carry no layer.
    for name in ["moe_ep2", "dense", "moe_domino"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../tests/golden/{name}.pb"));
        let wire = io::read_wire(&path).unwrap();
        let deep = deepen(&wire, "main", 0, 5).unwrap_or_else(|e| panic!("{name}: {e}"));
        let graph = Graph::from_wire(deep).unwrap_or_else(|e| panic!("{name}: {e}"));
        let model = graph.model_by_name("main").unwrap();
        assert_eq!(graph.model(model).num_layers, 5, "{name}");
    }
}
