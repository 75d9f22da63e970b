//! The fuzz targets: each feeds its input to one entry point of the planner and checks the
//! contract: no panic (libFuzzer reports one as a crash), bounded time and memory (libFuzzer's
//! `-timeout` and `-rss_limit_mb`), and an error that is one clean line, short, with every
//! name from the input escaped.

use std::path::Path;

use ir::{
    io::{self, Format},
    plan::{Collectives, Executor, Format as PlanFormat, Keep, Plan, RandomOps},
    Graph,
};
use planner::{
    budget::{BudgetError, Search, DEFAULT_STEPS},
    config::{parse_keep, PlanConfig},
    cost::HwProfile,
    inspect,
    plan::{self, PlanError},
};
use prost::Message;

use crate::graphs::GraphSpec;

/// The longest error message accepted: names are shortened, so a message is a few of them.
const MAX_MESSAGE: usize = 4096;

/// One line, no control characters, not too long.
pub fn check_message(message: &str) {
    assert!(!message.is_empty(), "an empty message");
    assert!(
        message.len() <= MAX_MESSAGE,
        "a message of {} bytes: {}...",
        message.len(),
        message.get(..200).unwrap_or_default()
    );
    assert!(
        !message.chars().any(char::is_control),
        "a control character in {message:?}"
    );
}

/// Inspect's text of a loaded graph: no control character but line ends, and its JSON form.
fn check_inspect(graph: &Graph) {
    let summary = inspect::summarize(graph);
    let text = inspect::render_text(&summary);
    assert!(
        !text.chars().any(|c| c != '\n' && c.is_control()),
        "a control character in the text"
    );
    assert!(text.ends_with('\n'));
    serde_json_check(&summary);
}

fn serde_json_check(summary: &inspect::Summary) {
    let json = serde_json::to_string(summary).expect("a summary serialises");
    assert!(json.starts_with('{'));
}

fn load(data: &[u8], format: Format) {
    match io::load_bytes(data, format, Path::new("fuzz")) {
        Ok(graph) => check_inspect(&graph),
        Err(error) => check_message(&error.to_string()),
    }
}

/// The `.pb` loader on arbitrary bytes.
pub fn load_pb(data: &[u8]) {
    load(data, Format::Protobuf);
}

/// The `.json` loader on arbitrary bytes.
pub fn load_json(data: &[u8]) {
    load(data, Format::Json);
}

/// `--hw` profile parsing on arbitrary bytes: a profile has finite positive rates, and
/// written back as JSON it reads back the same, to the bit.
pub fn hw_profile(data: &[u8]) {
    let origin = "hw.json";
    match HwProfile::from_json(data, origin) {
        Ok(hw) => {
            for rate in [
                hw.matmul_flops_per_s,
                hw.matmul_f32_flops_per_s,
                hw.matmul_f64_flops_per_s,
                hw.matmul_f8_flops_per_s,
                hw.vector_flops_per_s,
                hw.selection_ops_per_s,
                hw.hbm_bytes_per_s,
                hw.link_bytes_per_s,
                hw.memory_bytes,
            ] {
                assert!(rate.is_finite() && rate > 0.0, "rate {rate}");
            }
            let back = HwProfile::from_json(hw.to_json().as_bytes(), origin)
                .expect("a written profile reads");
            // Bit-exact: every rate is finite, so equality of the numbers is equality of bits
            // except for -0.0, which no positive rate is.
            assert!(
                back == hw,
                "the profile does not read back to the same bits"
            );
        }
        Err(message) => check_message(&message),
    }
}

/// Graphs made valid, then broken, loaded and rendered by `inspect`.
pub fn inspect_text(data: &[u8]) {
    let Some(spec) = GraphSpec::from_bytes(data) else {
        return;
    };
    load(&spec.wire().encode_to_vec(), Format::Protobuf);
}

/// pb -> json -> pb gives back the same bytes, with or without validation, and a valid graph
/// loads from either with one fingerprint.
pub fn convert_roundtrip(data: &[u8]) {
    let Some(spec) = GraphSpec::from_bytes(data) else {
        return;
    };
    let pb = spec.wire().encode_to_vec();
    let path = Path::new("fuzz");
    let json = match io::convert_bytes(&pb, Format::Protobuf, Format::Json, false, path) {
        Ok(json) => json,
        Err(error) => return check_message(&error.to_string()),
    };
    let back = io::convert_bytes(&json, Format::Json, Format::Protobuf, false, path)
        .unwrap_or_else(|e| panic!("the JSON written does not read back: {e}"));
    assert!(back == pb, "pb -> json -> pb changed the bytes");
    let from_pb = io::load_bytes(&pb, Format::Protobuf, path);
    let from_json = io::load_bytes(&json, Format::Json, path);
    match (from_pb, from_json) {
        (Ok(a), Ok(b)) => assert_eq!(a.fingerprint(), b.fingerprint()),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        (a, b) => panic!("pb and json load differently: {a:?} / {b:?}"),
    }
}

/// A `.pb` plan file's bytes, as `diff` and `run --plan` read them.
pub fn plan_pb(data: &[u8]) {
    plan(data, PlanFormat::Protobuf);
}

/// A `.json` plan file's bytes, as `diff` and `run --plan` read them.
pub fn plan_json(data: &[u8]) {
    plan(data, PlanFormat::Json);
}

/// A plan decodes or fails with one clean line; a decoded plan written back in its format
/// decodes again and writes the same bytes (the writer and the reader agree).
fn plan(data: &[u8], format: PlanFormat) {
    match Plan::decode(data, format) {
        Ok((plan, names)) => {
            let written = plan.encode(&names, format);
            let (back, back_names) = Plan::decode(&written, format)
                .unwrap_or_else(|e| panic!("a written plan does not read back: {e}"));
            assert!(
                back.encode(&back_names, format) == written,
                "a plan read back writes other bytes"
            );
        }
        Err(error) => check_message(&error.to_string()),
    }
}

/// How [`plan_graph`] plans its graph.
#[derive(Debug, arbitrary::Arbitrary)]
struct PlanOptions {
    /// None: keep nothing; an empty list: `--keep all`; else units picked by index.
    keep: Option<Vec<u8>>,
    /// `--recompute-ratio`, in percent (values over 100 are clamped).
    ratio_percent: u8,
    save_collectives: bool,
    replay_random: bool,
    eager: bool,
    /// Also search: the frontier, and `--budget` at each of its peaks.
    search: bool,
}

impl PlanOptions {
    fn config(&self, graph: &Graph) -> PlanConfig {
        let units: Vec<String> = graph
            .models()
            .values()
            .flat_map(|m| m.units.values().map(|u| u.name.to_string()))
            .collect();
        let keep = match &self.keep {
            None => Keep::Nothing,
            Some(picks) if picks.is_empty() || units.is_empty() => Keep::All,
            Some(picks) => {
                let names: Vec<String> = picks
                    .iter()
                    .map(|&p| units[usize::from(p) % units.len()].clone())
                    .collect();
                parse_keep(&names).unwrap_or(Keep::All)
            }
        };
        PlanConfig {
            keep,
            recompute_ratio: f64::from(self.ratio_percent.min(100)) / 100.0,
            collectives: if self.save_collectives {
                Collectives::Save
            } else {
                Collectives::Recompute
            },
            random_ops: if self.replay_random {
                RandomOps::Replay
            } else {
                RandomOps::Save
            },
            executor: if self.eager {
                Executor::Eager
            } else {
                Executor::Graph
            },
            ..PlanConfig::default()
        }
    }
}

/// The planner itself on generated valid graphs: a plan is made or refused with a clean
/// message naming the user's mistake, never an internal error (the partition verifier's
/// finding); a plan writes as JSON that reads back for this graph; a search answers every
/// budget on its frontier with a plan that fits.
pub fn plan_graph(data: &[u8]) {
    let mut input = arbitrary::Unstructured::new(data);
    let Ok(options) = <PlanOptions as arbitrary::Arbitrary>::arbitrary(&mut input) else {
        return;
    };
    let Ok(spec) = <GraphSpec as arbitrary::Arbitrary>::arbitrary_take_rest(input) else {
        return;
    };
    let graph = Graph::from_wire(spec.valid()).expect("a generated graph is valid");
    let config = options.config(&graph);
    let hw = HwProfile::default();
    match plan::plan(&graph, &config, &hw) {
        Ok(plan) => {
            let json = plan.encode(&graph, PlanFormat::Json);
            let (back, names) = Plan::decode(&json, PlanFormat::Json)
                .unwrap_or_else(|e| panic!("the plan's JSON does not read back: {e}"));
            back.resolve(&names, &graph)
                .unwrap_or_else(|e| panic!("the plan's JSON does not resolve: {e}"));
        }
        Err(PlanError::Config(error)) => return check_message(&error.to_string()),
        Err(internal) => panic!("{internal}"),
    }
    if options.search {
        search(&graph, &config, &hw);
    }
}

fn search(graph: &Graph, config: &PlanConfig, hw: &HwProfile) {
    let search = match Search::new(graph, config, hw) {
        Ok(search) => search,
        Err(BudgetError::Plan(PlanError::Partition(internal))) => panic!("{internal}"),
        Err(error) => return check_message(&error.to_string()),
    };
    let frontier = match search.frontier(DEFAULT_STEPS) {
        Ok(frontier) => frontier,
        Err(BudgetError::Plan(PlanError::Partition(internal))) => panic!("{internal}"),
        Err(error) => return check_message(&error.to_string()),
    };
    for point in &frontier {
        let budget = point.figures.peak_bytes;
        let plan = search
            .within(budget)
            .unwrap_or_else(|e| panic!("budget {budget} of a frontier point: {e}"));
        let peak = plan.memory.peak_bytes.unwrap_or(0);
        assert!(peak <= budget, "the answer's peak {peak} exceeds {budget}");
    }
}
