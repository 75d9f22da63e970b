//! A small builder of valid joint graphs for rule tests and property tests.

use ir::{
    wire::graph::{self as pb, attribute::Value as AttrValue},
    Graph,
};

pub const MODEL: &str = "main";

/// Builds a wire graph op by op; every op produces one fresh `[4, 4]` float32 value.
pub struct Builder {
    graph: pb::Graph,
    model: String,
    counter: usize,
    layer: Option<u32>,
    micro_batch: u32,
    region: String,
    phase: pb::Phase,
}

impl Builder {
    /// A model `main` with `num_layers` layers and the given units (`unit -> [(begin, end)]`).
    pub fn new(num_layers: u32, units: &[(&str, &[(&str, &str)])]) -> Builder {
        let graph = pb::Graph {
            name: "built".to_owned(),
            models: vec![pb::Model {
                name: MODEL.to_owned(),
                parent: String::new(),
                num_layers,
                units: units
                    .iter()
                    .map(|(unit, intervals)| pb::UnitIntervals {
                        unit: unit.to_string(),
                        intervals: intervals
                            .iter()
                            .map(|(b, e)| pb::MarkerInterval {
                                begin: b.to_string(),
                                end: e.to_string(),
                            })
                            .collect(),
                    })
                    .collect(),
            }],
            ..Default::default()
        };
        Builder {
            graph,
            model: MODEL.to_owned(),
            counter: 0,
            layer: None,
            micro_batch: 0,
            region: String::new(),
            phase: pb::Phase::Forward,
        }
    }

    fn declare(&mut self, name: String, role: pb::Role) -> String {
        self.graph.values.push(pb::Value {
            name: name.clone(),
            dtype: pb::Dtype::Float32 as i32,
            shape: vec![4, 4],
            role: role as i32,
        });
        name
    }

    pub fn input(&mut self, name: &str) -> String {
        self.declare(name.to_owned(), pb::Role::Input)
    }

    pub fn param(&mut self, name: &str) -> String {
        self.declare(name.to_owned(), pb::Role::Parameter)
    }

    pub fn tangent(&mut self, name: &str) -> String {
        self.declare(name.to_owned(), pb::Role::Tangent)
    }

    /// Declares another model (nested in `parent` if given) and makes it current.
    pub fn model(
        &mut self,
        name: &str,
        parent: &str,
        units: &[(&str, &[(&str, &str)])],
    ) -> &mut Self {
        let template = self.graph.models[0].clone();
        self.graph.models.push(pb::Model {
            name: name.to_owned(),
            parent: parent.to_owned(),
            units: Builder::new(0, units).graph.models.remove(0).units,
            ..template
        });
        self.model = name.to_owned();
        self
    }

    pub fn layer(&mut self, layer: Option<u32>) -> &mut Self {
        self.layer = layer;
        self
    }

    pub fn micro_batch(&mut self, micro_batch: u32) -> &mut Self {
        self.micro_batch = micro_batch;
        self
    }

    /// Ops added next run in this compiled region (`""` for eager).
    pub fn region(&mut self, region: &str) -> &mut Self {
        self.region = region.to_owned();
        self
    }

    pub fn backward(&mut self) -> &mut Self {
        self.phase = pb::Phase::Backward;
        self.layer = None;
        self.region.clear();
        self
    }

    /// Appends `op` reading `inputs`; returns (node name, output value).
    pub fn node(&mut self, op: &str, inputs: &[&str]) -> (String, String) {
        self.node_with(op, inputs, None)
    }

    pub fn node_with(
        &mut self,
        op: &str,
        inputs: &[&str],
        schema: Option<pb::SchemaFacts>,
    ) -> (String, String) {
        self.counter += 1;
        let name = format!("n{}", self.counter);
        let role = match self.phase {
            pb::Phase::Backward => pb::Role::Gradient,
            _ => pb::Role::Activation,
        };
        let out = self.declare(format!("v{}", self.counter), role);
        self.graph.nodes.push(pb::Node {
            name: name.clone(),
            op: op.to_owned(),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            outputs: vec![out.clone()],
            phase: self.phase as i32,
            model: self.model.clone(),
            layer: self.layer,
            compiled_region: self.region.clone(),
            micro_batch: self.micro_batch,
            schema,
            ..Default::default()
        });
        (name, out)
    }

    /// An in-place op `op` that writes each of `written` (its first inputs) and reads
    /// `reads`; returns its output (the first written tensor after the write).
    pub fn write_in_place(&mut self, op: &str, written: &[&str], reads: &[&str]) -> String {
        let inputs: Vec<&str> = written.iter().chain(reads).copied().collect();
        let facts = pb::SchemaFacts {
            mutates: (0..written.len() as u32).collect(),
            ..Default::default()
        };
        self.node_with(op, &inputs, Some(facts)).1
    }

    /// `mm(x, w)` and friends: a compute op.
    pub fn op(&mut self, x: &str) -> String {
        self.node("aten.sin.default", &[x]).1
    }

    pub fn marker(&mut self, marker: &str, x: &str) -> String {
        let (_, out) = self.node(ir::MARKER_OP, &[x]);
        let node = self.graph.nodes.last_mut().expect("just pushed");
        node.attributes.push(pb::Attribute {
            name: "name".to_owned(),
            value: Some(AttrValue::Str(marker.to_owned())),
        });
        out
    }

    /// Backward from tangent `tangent`: one `mul` per value in `reads`, in that order, each
    /// reading it and the running gradient; the last gradient is the graph output.
    pub fn backward_through<S: AsRef<str>>(&mut self, tangent: &str, reads: &[S]) {
        let mut grad = self.tangent(tangent);
        self.backward();
        for r in reads {
            grad = self.node("aten.mul.Tensor", &[r.as_ref(), &grad]).1;
        }
        self.output(&grad);
    }

    pub fn output(&mut self, value: &str) {
        self.graph.outputs.push(value.to_owned());
    }

    pub fn wire(&self) -> pb::Graph {
        self.graph.clone()
    }

    pub fn build(&self) -> Graph {
        Graph::from_wire(self.graph.clone()).expect("the builder makes valid graphs")
    }
}

/// `index_put(dest [4, 128], [idx [4096]], vals [4096, 128], accumulate=True)`: every row of
/// `vals` is added into row `idx[i]` of `dest`, half a million additions, which libtorch's CPU
/// kernel splits over threads with atomic adds (in no fixed order) unless asked to be
/// deterministic.
pub fn accumulating_index_put() -> Graph {
    let mut b = Builder::new(1, &[]);
    let dest = b.input("dest");
    let idx = b.input("idx");
    let vals = b.input("vals");
    let (_, out) = b.node("aten.index_put.default", &[&dest, &idx, &vals]);
    b.output(&out);
    let mut wire = b.wire();
    for value in &mut wire.values {
        let (dtype, shape) = match value.name.as_str() {
            "idx" => (pb::Dtype::Int64, vec![4096]),
            "vals" => (pb::Dtype::Float32, vec![4096, 128]),
            _ => (pb::Dtype::Float32, vec![4, 128]),
        };
        value.dtype = dtype as i32;
        value.shape = shape;
    }
    wire.nodes[0].attributes.push(pb::Attribute {
        name: "accumulate".to_owned(),
        value: Some(pb::attribute::Value::Bool(true)),
    });
    Graph::from_wire(wire).expect("valid")
}

/// Two checkpointed layers with one unit (`SAVE_ATTN` around each layer's middle op) whose
/// backward reads every forward value, the marker outputs and their inputs included: the
/// activations held for backward dominate the peak (one gradient is all the step outputs).
/// Every value is `[4, 4]` float32 until the caller resizes them.
pub fn activation_dominated() -> Builder {
    let mut b = Builder::new(2, &[("SAVE_ATTN", &[("attn.begin", "attn.end")])]);
    let mut h = b.input("x");
    let mut reads = Vec::new();
    for layer in 0..2 {
        b.layer(Some(layer));
        let a = b.op(&h);
        let begin = b.marker("attn.begin", &a);
        let inner = b.op(&begin);
        let end = b.marker("attn.end", &inner);
        h = b.op(&end);
        reads.extend([a, begin, inner, end, h.clone()]);
    }
    b.layer(None);
    reads.reverse();
    b.backward_through("tangent", &reads);
    b
}
