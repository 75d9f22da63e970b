//! The data-dependency DAG over nodes, private to this crate and built only to name a node on
//! a cycle when a graph is not in execution order (neighbour queries use the graph's producer
//! and consumer tables). Node index `i` is `NodeId` `i`.

use petgraph::{algo, graph::DiGraph, graph::NodeIndex};

use crate::id::{EntityId, IdVec, NodeId, ValueId};

#[derive(Debug)]
pub(crate) struct Dag {
    graph: DiGraph<(), ValueId, u32>,
}

impl Dag {
    /// One edge `producer -> consumer` per value a node reads.
    pub(crate) fn build(
        node_inputs: impl ExactSizeIterator<Item = impl IntoIterator<Item = ValueId>>,
        producers: &IdVec<ValueId, Option<NodeId>>,
    ) -> Self {
        let mut graph = DiGraph::with_capacity(node_inputs.len(), 0);
        let count = node_inputs.len();
        for _ in 0..count {
            graph.add_node(());
        }
        for (consumer, inputs) in node_inputs.enumerate() {
            for value in inputs {
                if let Some(producer) = producers[value] {
                    graph.add_edge(
                        NodeIndex::new(producer.index()),
                        NodeIndex::new(consumer),
                        value,
                    );
                }
            }
        }
        Self { graph }
    }

    /// A node on a dependency cycle, if there is one.
    pub(crate) fn node_on_cycle(&self) -> Option<NodeId> {
        algo::toposort(&self.graph, None)
            .err()
            .map(|cycle| NodeId::from_index(cycle.node_id().index()))
    }
}
