//! The plan's two formats read back as the plan that was written: every golden graph, planned
//! under several configurations, survives JSON and protobuf exactly (floats included), and a
//! plan read for another graph is refused.

use ir::{
    plan::{Format, Keep, Plan, PlanReadError},
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

#[test]
fn every_plan_reads_back_exactly_from_json_and_protobuf() {
    for (name, graph) in graphs() {
        for config in configs() {
            let written = plan(&graph, &config, &HwProfile::default()).unwrap();
            for format in [Format::Json, Format::Protobuf] {
                let bytes = written.encode(&graph, format);
                let (read, names) = Plan::decode(&bytes, format)
                    .unwrap_or_else(|e| panic!("{name} {format:?}: {e}"));
                let resolved = read.resolve(&names, &graph).unwrap();
                // Plans are large: say which one differs, not both in full.
                assert!(resolved == written, "{name} {format:?} {config:?}");
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
