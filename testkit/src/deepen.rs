//! Deep graphs from shallow ones: repeats a golden graph's decoder layer N times, forward and
//! backward, so planning can be measured at DeepSeek-V3 depth (61 layers) and far beyond.
//!
//! The input needs two structurally identical adjacent layers `a` and `a + 1` of one model
//! (same ops in the same order, forward and backward). Layer `a` is the template; layer `a + 1`
//! shows how one layer hands over to the next: wherever the template's slot reads a value made
//! by the layer before (or by the next layer's backward), the copy reads the neighbouring copy's
//! value at the same position. Per-layer parameters are duplicated per copy, values shared by
//! both layers (positions, masks) stay shared, and every other node keeps its place around the
//! run of copies. What the export observed of the model's Python references
//! (`Node.python_releases`) is left out: it names values of particular layers, which the copies
//! rename.

use std::collections::{HashMap, HashSet};

use thiserror::Error;

use ir::wire::graph as pb;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DeepenError {
    #[error("model `{0}` is not declared")]
    UnknownModel(String),
    #[error(
        "layers {a} and {b} of model `{model}` differ ({why}): they must be identical to repeat"
    )]
    NotIdentical {
        model: String,
        a: u32,
        b: u32,
        why: String,
    },
    #[error("value `{0}` is read but never declared")]
    Undeclared(String),
}

/// Where a value of a layer comes from: output `output` of the layer's `node`-th node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    node: usize,
    output: usize,
}

/// `graph` with layer `a` of `model` repeated `layers` times in place of layers `a` and `a + 1`.
pub fn deepen(
    graph: &pb::Graph,
    model: &str,
    a: u32,
    layers: u32,
) -> Result<pb::Graph, DeepenError> {
    let declared = graph
        .models
        .iter()
        .position(|m| m.name == model)
        .ok_or_else(|| DeepenError::UnknownModel(model.to_owned()))?;
    let layer_of = effective_layers(graph, model);
    let in_layer = |l: u32| -> Vec<usize> {
        (0..graph.nodes.len())
            .filter(|&i| layer_of[i] == Some(l))
            .collect()
    };
    let (ta, tb) = (in_layer(a), in_layer(a + 1));
    check_identical(graph, model, a, &ta, &tb)?;
    let values: HashMap<&str, &pb::Value> =
        graph.values.iter().map(|v| (v.name.as_str(), v)).collect();
    let plan = Deepening::new(graph, model, a, layers.max(1), ta, tb);
    let mut out = Builder {
        values: &values,
        nodes: Vec::new(),
        declared: Vec::new(),
        seen: HashSet::new(),
    };
    plan.emit(&mut out)?;
    let mut result = graph.clone();
    result.name = format!("{}_x{}", graph.name, plan.copies);
    result.outputs = deepen_outputs(graph, &plan.ta, &plan.tb, plan.copies, &out.seen);
    result.nodes = out.nodes;
    result.values = out.declared;
    result.models[declared].num_layers = (graph.models[declared].num_layers - 2) + plan.copies;
    Ok(result)
}

/// How the template layer `a` (nodes `ta`) and its successor `a + 1` (nodes `tb`) become
/// `copies` layers.
struct Deepening<'g> {
    graph: &'g pb::Graph,
    model: &'g str,
    a: u32,
    copies: u32,
    ta: Vec<usize>,
    tb: Vec<usize>,
    /// Where each value of layer `a` (or `a + 1`) is made: template node and output.
    made_by_a: HashMap<&'g str, Slot>,
    made_by_b: HashMap<&'g str, Slot>,
    /// The forward pass ends at the last forward node: what runs before it (AOTAutograd's
    /// backward-phase `detach` of saved outputs included) repeats with the forward copies.
    backward_starts: usize,
}

impl<'g> Deepening<'g> {
    fn new(
        graph: &'g pb::Graph,
        model: &'g str,
        a: u32,
        copies: u32,
        ta: Vec<usize>,
        tb: Vec<usize>,
    ) -> Self {
        let producer_of = |nodes: &[usize]| -> HashMap<&'g str, Slot> {
            nodes
                .iter()
                .enumerate()
                .flat_map(|(k, &i)| {
                    graph.nodes[i]
                        .outputs
                        .iter()
                        .enumerate()
                        .map(move |(j, v)| (v.as_str(), Slot { node: k, output: j }))
                })
                .collect()
        };
        let backward_starts = graph
            .nodes
            .iter()
            .rposition(|n| n.phase == pb::Phase::Forward as i32)
            .map_or(0, |i| i + 1);
        Deepening {
            graph,
            model,
            a,
            copies,
            made_by_a: producer_of(&ta),
            made_by_b: producer_of(&tb),
            ta,
            tb,
            backward_starts,
        }
    }

    fn early(&self, node: usize) -> bool {
        node < self.backward_starts
    }

    /// The name of template output `at` in copy `c`.
    fn name_of(&self, at: Slot, c: u32) -> String {
        copy_name(&self.graph.nodes[self.ta[at.node]].outputs[at.output], c)
    }

    /// The template's input at (node k, input s) in copy c.
    fn input_of(&self, k: usize, s: usize, c: u32) -> String {
        let va = &self.graph.nodes[self.ta[k]].inputs[s];
        let vb = &self.graph.nodes[self.tb[k]].inputs[s];
        if let Some(&at) = self.made_by_a.get(va.as_str()) {
            return self.name_of(at, c);
        }
        if let Some(&at) = self.made_by_b.get(va.as_str()) {
            // Backward reads the next layer's gradient: the next copy's, or what the last
            // layer reads from outside.
            return if c + 1 < self.copies {
                self.name_of(at, c + 1)
            } else {
                vb.clone()
            };
        }
        if va == vb {
            return va.clone(); // shared by every layer
        }
        if let Some(&at) = self.made_by_a.get(vb.as_str()) {
            // The layer's input: the previous copy's output, or what layer a reads.
            return if c == 0 {
                va.clone()
            } else {
                self.name_of(at, c - 1)
            };
        }
        copy_name(va, c) // a per-layer parameter
    }

    /// What a node outside the two layers reads: the first or last copy of a layer value.
    fn outside(&self, v: &str) -> String {
        if let Some(&at) = self.made_by_b.get(v) {
            return self.name_of(at, self.copies - 1);
        }
        if let Some(&at) = self.made_by_a.get(v) {
            return self.name_of(at, 0);
        }
        v.to_owned()
    }

    /// Every copy of the template's forward (in layer order) or backward (reversed) nodes.
    fn emit_copies(&self, out: &mut Builder<'_>, forward_pass: bool) -> Result<(), DeepenError> {
        let order: Vec<u32> = if forward_pass {
            (0..self.copies).collect()
        } else {
            (0..self.copies).rev().collect()
        };
        for c in order {
            for (k, &i) in self.ta.iter().enumerate() {
                if self.early(i) != forward_pass {
                    continue;
                }
                let n = &self.graph.nodes[i];
                let inputs = (0..n.inputs.len())
                    .map(|s| self.input_of(k, s, c))
                    .collect();
                let outputs = (0..n.outputs.len())
                    .map(|output| self.name_of(Slot { node: k, output }, c))
                    .collect();
                let layer = n.layer.map(|_| c + self.a);
                out.node(n, copy_name(&n.name, c), inputs, outputs, layer)?;
            }
        }
        Ok(())
    }

    /// The whole graph: nodes outside the two layers in place, the copies where the layers
    /// were, later layers of the model renumbered.
    fn emit(&self, out: &mut Builder<'_>) -> Result<(), DeepenError> {
        let layer_nodes: HashSet<usize> = self.ta.iter().chain(&self.tb).copied().collect();
        let first_a = self.ta[0];
        let (mut forward_done, mut backward_done) = (false, false);
        for (i, n) in self.graph.nodes.iter().enumerate() {
            if layer_nodes.contains(&i) {
                if i >= first_a && self.early(i) && !forward_done {
                    self.emit_copies(out, true)?;
                    forward_done = true;
                }
                if !self.early(i) && !backward_done {
                    self.emit_copies(out, false)?;
                    backward_done = true;
                }
                continue;
            }
            let inputs = n.inputs.iter().map(|v| self.outside(v)).collect();
            let layer = n.layer.map(|l| {
                if l > self.a + 1 && n.model == self.model {
                    l + self.copies - 2
                } else {
                    l
                }
            });
            out.node(n, n.name.clone(), inputs, n.outputs.clone(), layer)?;
        }
        Ok(())
    }
}

/// The op autograd inserts to sum the gradients of a tensor used twice.
const ACCUMULATE_OP: &str = "aten.add.Tensor";

/// Each node's layer of `model`, where backward nodes without one (the gradient-accumulation
/// adds autograd inserts outside any module scope) take the lowest layer among the gradients
/// they read: summing the gradient that reaches layer `l` from above with the one from inside
/// `l` is part of `l`'s backward. Forward activations they read do not count.
fn effective_layers(graph: &pb::Graph, model: &str) -> Vec<Option<u32>> {
    // Layer of each gradient made in backward.
    let mut made_in: HashMap<&str, Option<u32>> = HashMap::new();
    let mut layers = Vec::with_capacity(graph.nodes.len());
    for n in &graph.nodes {
        let backward = n.phase == pb::Phase::Backward as i32;
        let layer = if n.model != model {
            None
        } else if n.layer.is_some() || !backward || n.op != ACCUMULATE_OP {
            n.layer
        } else {
            n.inputs
                .iter()
                .filter_map(|v| made_in.get(v.as_str()).copied().flatten())
                .min()
        };
        if backward {
            for v in &n.outputs {
                made_in.insert(v, layer);
            }
        }
        layers.push(layer);
    }
    layers
}

fn copy_name(name: &str, c: u32) -> String {
    format!("{name}@{c}")
}

fn check_identical(
    graph: &pb::Graph,
    model: &str,
    a: u32,
    ta: &[usize],
    tb: &[usize],
) -> Result<(), DeepenError> {
    let differ = |why: String| DeepenError::NotIdentical {
        model: model.to_owned(),
        a,
        b: a + 1,
        why,
    };
    if ta.is_empty() || ta.len() != tb.len() {
        return Err(differ(format!("{} vs {} nodes", ta.len(), tb.len())));
    }
    for (&i, &j) in ta.iter().zip(tb) {
        let (x, y) = (&graph.nodes[i], &graph.nodes[j]);
        if x.op != y.op || x.inputs.len() != y.inputs.len() || x.outputs.len() != y.outputs.len() {
            return Err(differ(format!(
                "`{}` ({}) vs `{}` ({})",
                x.name, x.op, y.name, y.op
            )));
        }
    }
    Ok(())
}

/// Graph outputs: the template's gradients once per copy, the second layer's dropped.
fn deepen_outputs(
    graph: &pb::Graph,
    ta: &[usize],
    tb: &[usize],
    copies: u32,
    seen: &HashSet<String>,
) -> Vec<String> {
    let made = |nodes: &[usize]| -> HashMap<&str, ()> {
        nodes
            .iter()
            .flat_map(|&i| graph.nodes[i].outputs.iter().map(|v| (v.as_str(), ())))
            .collect()
    };
    let (by_a, by_b) = (made(ta), made(tb));
    let mut outputs = Vec::new();
    for v in &graph.outputs {
        if by_b.contains_key(v.as_str()) {
            continue;
        }
        if by_a.contains_key(v.as_str()) {
            outputs.extend(
                (0..copies)
                    .map(|c| copy_name(v, c))
                    .filter(|n| seen.contains(n)),
            );
        } else {
            outputs.push(v.clone());
        }
    }
    outputs
}

/// Collects the new node list and declares each value once, on first sight; a copy `v@c` is
/// declared like its template `v` (dtype, shape, role).
struct Builder<'g> {
    values: &'g HashMap<&'g str, &'g pb::Value>,
    nodes: Vec<pb::Node>,
    declared: Vec<pb::Value>,
    seen: HashSet<String>,
}

impl Builder<'_> {
    fn node(
        &mut self,
        template: &pb::Node,
        name: String,
        inputs: Vec<String>,
        outputs: Vec<String>,
        layer: Option<u32>,
    ) -> Result<(), DeepenError> {
        for v in inputs.iter().chain(&outputs) {
            if self.seen.contains(v) {
                continue;
            }
            let base = v.rsplit_once('@').map_or(v.as_str(), |(base, _)| base);
            let mut value = (*self
                .values
                .get(base)
                .ok_or_else(|| DeepenError::Undeclared(v.clone()))?)
            .clone();
            value.name = v.clone();
            self.declared.push(value);
            self.seen.insert(v.clone());
        }
        self.nodes.push(pb::Node {
            name,
            inputs,
            outputs,
            layer,
            python_releases: Vec::new(),
            ..template.clone()
        });
        Ok(())
    }
}
