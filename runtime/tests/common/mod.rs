//! Helpers shared by the runtime's tests: goldens, plans without checkpointing, and graphs
//! built op by op.

#![allow(dead_code)]

use std::{path::PathBuf, sync::Arc, time::Duration};

use ir::{
    plan::{Config, Cost, GraphRef, Keep, Memory, Plan, SavedKind, SavedValue},
    Graph,
};
use runtime::{
    run::{RankJob, RunConfig},
    Device,
};

pub fn golden(name: &str) -> Graph {
    ir::io::load(&testkit::golden_graph(name)).expect("the golden loads")
}

pub fn golden_tensors(name: &str) -> PathBuf {
    testkit::golden_graph(name).with_extension("safetensors")
}

/// A plan that checkpoints nothing: every graph input and forward value is saved.
pub fn plan_without_checkpointing(graph: &Graph) -> Plan {
    let saved = graph
        .values()
        .iter()
        .map(|(value, v)| SavedValue {
            value,
            alias_of: None,
            bytes: v.bytes,
            model: None,
            layer: None,
            kind: SavedKind::NotCheckpointed,
        })
        .collect();
    Plan {
        planner_version: ir::plan::PLANNER_VERSION.to_owned(),
        graph: GraphRef {
            name: graph.name().to_owned(),
            fingerprint: graph.fingerprint().to_owned(),
        },
        config: Config {
            keep: Keep::Nothing,
            recompute_ratio: 0.0,
            collectives: Default::default(),
            random_ops: Default::default(),
            executor: Default::default(),
            budget_bytes: None,
            layer_keep: Vec::new(),
            training: Default::default(),
        },
        joint: true,
        nodes: Vec::new(),
        saved,
        replay: Vec::new(),
        units: Vec::new(),
        memory: Memory::default(),
        cost: Cost::default(),
        diagnostics: Vec::new(),
    }
}

/// One job per rank running `graph` without checkpointing on the golden's tensors.
pub fn jobs(name: &str, ranks: usize) -> Vec<RankJob> {
    let graph = Arc::new(golden(name));
    let plan = Arc::new(plan_without_checkpointing(&graph));
    let job = RankJob {
        graph,
        plan,
        whole_layer: None,
        inputs: golden_tensors(name),
    };
    vec![job; ranks]
}

pub fn config(timeout: Duration) -> RunConfig {
    RunConfig {
        device: Device::Cpu,
        seed: Some(7),
        check: false,
        timeout,
        max_input_bytes: u64::MAX,
        fault: None,
    }
}
