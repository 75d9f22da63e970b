//! The data-dependency DAG over nodes, private to this crate: petgraph indices never escape,
//! callers see [`NodeId`]s. Built once at load and never mutated, so node index `i` is always
//! `NodeId` `i`.

use petgraph::{algo, graph::DiGraph, graph::NodeIndex, Direction};

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
                    graph.add_edge(index(producer), NodeIndex::new(consumer), value);
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

    pub(crate) fn predecessors(&self, node: NodeId) -> Vec<NodeId> {
        self.neighbors(node, Direction::Incoming)
    }

    pub(crate) fn successors(&self, node: NodeId) -> Vec<NodeId> {
        self.neighbors(node, Direction::Outgoing)
    }

    fn neighbors(&self, node: NodeId, direction: Direction) -> Vec<NodeId> {
        let mut ids: Vec<NodeId> = self
            .graph
            .neighbors_directed(index(node), direction)
            .map(|n| NodeId::from_index(n.index()))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

fn index(node: NodeId) -> NodeIndex<u32> {
    NodeIndex::new(node.index())
}
