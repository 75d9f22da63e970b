//! The plan's two formats read back as the plan that was written: every golden graph, planned
//! under several configurations, survives JSON and protobuf exactly (floats included), and a
//! plan read for another graph is refused.

use std::collections::BTreeSet;

use ir::{
    plan::{Format, Keep, LayerKeep, LayerOffload, LayerRef, Plan, PlanReadError},
    Graph,
};
use planner::{config::PlanConfig, cost::HwProfile, plan::plan};
use testkit::{golden_graph, repo_root};

fn graphs() -> Vec<(String, Graph)> {
    let mut graphs = vec![(
        "two_layer_moe".to_owned(),
        ir::io::load(&repo_root().join("tests/fixtures/two_layer_moe.pb")).unwrap(),
    )];
    for name in ["dense", "dense_forward", "moe_ep2", "glm_dsa_ep2_compiled"] {
        graphs.push((name.to_owned(), ir::io::load(&golden_graph(name)).unwrap()));
    }
    graphs
}

fn configs() -> Vec<PlanConfig> {
    vec![
        PlanConfig::default(),
        PlanConfig {
            keep: Keep::All,
            recompute_ratio: 0.5,
            ..PlanConfig::default()
        },
    ]
}

/// Per-layer choices of `dense`: layer 0 keeps `SAVE_ATTN` and offloads it and its layer
/// inputs, layer 1 keeps nothing.
fn dense_with_choices() -> Plan {
    let graph = ir::io::load(&golden_graph("dense")).unwrap();
    let choices = br#"{"layer_keep": [{"model": "main", "layer": 0, "keep": ["SAVE_ATTN"]},
        {"model": "main", "layer": 1, "keep": []}], "layer_offload": [{"model": "main",
        "layer": 0, "offload": ["SAVE_ATTN"], "layer_input": true}]}"#;
    let choices = planner::config::parse_choices(&graph, choices).unwrap();
    let config = PlanConfig::default();
    planner::plan::plan_with_choices(&graph, &config, choices, &HwProfile::default()).unwrap()
}

/// `plan` and `dense_with_choices` of each graph (the choices on `dense` only).
fn plans_of(name: &str, graph: &Graph) -> Vec<Plan> {
    let mut plans: Vec<Plan> = configs()
        .iter()
        .map(|config| plan(graph, config, &HwProfile::default()).unwrap())
        .collect();
    if name == "dense" {
        plans.push(dense_with_choices());
    }
    plans
}

#[test]
fn every_plan_reads_back_exactly_from_json_and_protobuf() {
    for (name, graph) in graphs() {
        for written in plans_of(&name, &graph) {
            let config = &written.config;
            for format in [Format::Json, Format::Protobuf] {
                let bytes = written.encode(&graph, format);
                let (read, names) = Plan::decode(&bytes, format)
                    .unwrap_or_else(|e| panic!("{name} {format:?}: {e}"));
                let resolved = read.resolve(&names, &graph).unwrap();
                // Plans are large: say which one differs, not both in full.
                assert!(resolved == written, "{name} {format:?} {config:?}");
                if !config.layer_offload.is_empty() {
                    assert!(resolved.config.layer_offload[0].layer_input);
                }
                assert!(
                    resolved.encode(&graph, format) == bytes,
                    "{name} {format:?}: re-encoding is byte-identical"
                );
            }
        }
    }
}

#[test]
fn a_plan_read_for_another_graph_is_refused_naming_both() {
    let dense = ir::io::load(&golden_graph("dense")).unwrap();
    let moe = ir::io::load(&golden_graph("moe_ep2")).unwrap();
    let written = plan(&dense, &PlanConfig::default(), &HwProfile::default()).unwrap();
    let (read, names) = Plan::decode(&written.encode(&dense, Format::Json), Format::Json).unwrap();
    match read.resolve(&names, &moe) {
        Err(PlanReadError::Mismatch(m)) => {
            assert_eq!(m.plan_fingerprint, dense.fingerprint());
            assert_eq!(m.fingerprint, moe.fingerprint());
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn unknown_enum_spellings_are_errors_naming_the_field_and_the_valid_ones() {
    let graph = ir::io::load(&golden_graph("dense")).unwrap();
    let written = plan(&graph, &PlanConfig::default(), &HwProfile::default()).unwrap();
    let json = String::from_utf8(written.encode(&graph, Format::Json)).unwrap();
    let broken = json.replacen("\"decision\": \"recompute\"", "\"decision\": \"maybe\"", 1);
    let err = Plan::decode(broken.as_bytes(), Format::Json).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("decision `maybe`"), "{message}");
    assert!(
        message.contains("save, recompute, no-checkpoint"),
        "{message}"
    );
}

/// The JSON writer (`ir::plan::json`: serde, through views of the typed plan) writes every field of
/// `plan.proto` and no other, in every message: a field added to the schema fails here until
/// the writer writes it.
#[test]
fn the_json_writer_writes_exactly_the_fields_of_plan_proto() {
    use prost::Message as _;
    let file = prost_types::FileDescriptorProto::decode(ir::wire::PLAN_DESCRIPTOR).unwrap();
    let graph = ir::io::load(&golden_graph("glm_dsa_ep2")).unwrap();
    let mut checked = BTreeSet::new();
    // Nothing kept (diagnostics), and everything kept in half the layers (unit summaries).
    for config in configs() {
        let mut written = plan(&graph, &config, &HwProfile::default()).unwrap();
        // Layer choices, so that `LayerKeep` and `LayerOffload` are written too.
        let first = written.nodes[0];
        let layer = LayerKeep {
            at: LayerRef {
                model: first.model,
                layer: 0,
            },
            units: Vec::new(),
        };
        written.config.layer_offload = vec![LayerOffload {
            at: layer.at,
            units: layer.units.clone(),
            layer_input: true,
        }];
        written.config.layer_keep = vec![layer];
        let json: serde_json::Value =
            serde_json::from_slice(&written.encode(&graph, Format::Json)).unwrap();
        check_fields(&json, "Plan", &file, &mut checked);
    }
    let all: BTreeSet<String> = file
        .message_type
        .iter()
        .map(|m| m.name().to_owned())
        .collect();
    assert_eq!(checked, all, "every message of plan.proto is checked");
}

/// Checks that the JSON object `value` has exactly the fields of `message`, and its nested
/// messages theirs; records the messages checked.
fn check_fields(
    value: &serde_json::Value,
    message: &str,
    file: &prost_types::FileDescriptorProto,
    checked: &mut BTreeSet<String>,
) {
    let descriptor = file
        .message_type
        .iter()
        .find(|m| m.name() == message)
        .unwrap();
    let object = value
        .as_object()
        .unwrap_or_else(|| panic!("{message}: {value}"));
    let written: BTreeSet<&str> = object.keys().map(String::as_str).collect();
    let declared: BTreeSet<&str> = descriptor.field.iter().map(|f| f.name()).collect();
    assert_eq!(written, declared, "the JSON keys of {message}");
    checked.insert(message.to_owned());
    for field in &descriptor.field {
        let Some(nested) = field.type_name.as_deref() else {
            continue;
        };
        let nested = nested.rsplit('.').next().unwrap();
        match &object[field.name()] {
            serde_json::Value::Array(items) => {
                for item in items {
                    check_fields(item, nested, file, checked);
                }
            }
            serde_json::Value::Null => {}
            item => check_fields(item, nested, file, checked),
        }
    }
}
