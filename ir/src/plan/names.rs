//! The names behind a plan's ids: the graph's own, or the table a plan file carries, and the
//! re-binding of a read plan to the ids of the graph it was made for.

use rustc_hash::FxHashMap;

use super::{
    Diagnostic, LayerKeep, LayerOffload, LayerRef, NodeDecision, Peak, Plan, PlanReadError, Replay,
    SavedValue, UnitSummary,
};
use crate::{EntityId, Graph, IdVec, ModelId, Name, NodeId, UnitId, ValueId};

/// What a plan's ids are called.
pub trait PlanNames {
    fn node(&self, id: NodeId) -> &str;
    /// The op of node `id`.
    fn op(&self, id: NodeId) -> &str;
    fn value(&self, id: ValueId) -> &str;
    fn model(&self, id: ModelId) -> &str;
    fn unit(&self, model: ModelId, unit: UnitId) -> &str;
}

impl PlanNames for Graph {
    fn node(&self, id: NodeId) -> &str {
        &self.node(id).name
    }

    fn op(&self, id: NodeId) -> &str {
        &self.node(id).op
    }

    fn value(&self, id: ValueId) -> &str {
        &self.value(id).name
    }

    fn model(&self, id: ModelId) -> &str {
        &self.model(id).name
    }

    fn unit(&self, model: ModelId, unit: UnitId) -> &str {
        &self.model(model).units[unit].name
    }
}

/// The names a plan file holds, interned in first-seen order: the ids of a plan read from a
/// file index this table until [`Plan::resolve`] re-binds them to a graph.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct NameTable {
    nodes: IdVec<NodeId, (Name, Name)>,
    values: IdVec<ValueId, Name>,
    models: IdVec<ModelId, ModelNames>,
    node_ids: FxHashMap<Name, NodeId>,
    value_ids: FxHashMap<Name, ValueId>,
    model_ids: FxHashMap<String, ModelId>,
}

#[derive(Debug, Default, Clone, PartialEq)]
struct ModelNames {
    name: String,
    units: IdVec<UnitId, String>,
}

impl NameTable {
    /// The id of node `name`, interned with `op` when first seen (a node seen only as a
    /// replay's `before` has no op in the file, so a later sighting fills it in).
    pub(crate) fn node(&mut self, name: &str, op: &str) -> NodeId {
        if let Some(&id) = self.node_ids.get(name) {
            if self.nodes[id].1.is_empty() {
                self.nodes[id].1 = Name::new(op);
            }
            return id;
        }
        let id = self.nodes.push((Name::new(name), Name::new(op)));
        self.node_ids.insert(Name::new(name), id);
        id
    }

    pub(crate) fn value(&mut self, name: &str) -> ValueId {
        if let Some(&id) = self.value_ids.get(name) {
            return id;
        }
        let id = self.values.push(Name::new(name));
        self.value_ids.insert(Name::new(name), id);
        id
    }

    pub(crate) fn model(&mut self, name: &str) -> ModelId {
        if let Some(&id) = self.model_ids.get(name) {
            return id;
        }
        let id = self.models.push(ModelNames {
            name: name.to_owned(),
            units: IdVec::new(),
        });
        self.model_ids.insert(name.to_owned(), id);
        id
    }

    pub(crate) fn unit(&mut self, model: ModelId, name: &str) -> UnitId {
        let units = &mut self.models[model].units;
        let known = units.iter().find(|(_, u)| *u == name).map(|(id, _)| id);
        known.unwrap_or_else(|| units.push(name.to_owned()))
    }

    /// The id of node `name` in this table, if the plan names it.
    pub fn node_id(&self, name: &str) -> Option<NodeId> {
        self.node_ids.get(name).copied()
    }
}

impl PlanNames for NameTable {
    fn node(&self, id: NodeId) -> &str {
        &self.nodes[id].0
    }

    fn op(&self, id: NodeId) -> &str {
        &self.nodes[id].1
    }

    fn value(&self, id: ValueId) -> &str {
        &self.values[id]
    }

    fn model(&self, id: ModelId) -> &str {
        &self.models[id].name
    }

    fn unit(&self, model: ModelId, unit: UnitId) -> &str {
        &self.models[model].units[unit]
    }
}

/// The ids of a graph for the names of a [`NameTable`].
struct Binding {
    nodes: IdVec<NodeId, NodeId>,
    values: IdVec<ValueId, ValueId>,
    models: IdVec<ModelId, ModelId>,
    units: IdVec<ModelId, IdVec<UnitId, UnitId>>,
}

impl Binding {
    fn new(names: &NameTable, graph: &Graph) -> Result<Self, PlanReadError> {
        let unresolved = |what: &'static str, name: &str| PlanReadError::Unresolved {
            what,
            name: name.to_owned(),
            graph: graph.name().to_owned(),
        };
        let node_ids: FxHashMap<&str, NodeId> = graph
            .nodes()
            .iter()
            .map(|(id, n)| (n.name.as_str(), id))
            .collect();
        let value_ids: FxHashMap<&str, ValueId> = graph
            .values()
            .iter()
            .map(|(id, v)| (v.name.as_str(), id))
            .collect();
        let nodes = bind(names.nodes.values().map(|(n, _)| n.as_str()), |n| {
            node_ids
                .get(n)
                .copied()
                .ok_or_else(|| unresolved("node", n))
        })?;
        let values = bind(names.values.values().map(Name::as_str), |v| {
            value_ids
                .get(v)
                .copied()
                .ok_or_else(|| unresolved("value", v))
        })?;
        let models = bind(names.models.values().map(|m| m.name.as_str()), |m| {
            graph.model_by_name(m).ok_or_else(|| unresolved("model", m))
        })?;
        let units = names
            .models
            .iter()
            .map(|(file_model, m)| {
                let declared = &graph.model(models[file_model]).units;
                bind(m.units.values().map(String::as_str), |u| {
                    declared
                        .iter()
                        .find(|(_, d)| d.name == u)
                        .map(|(id, _)| id)
                        .ok_or_else(|| unresolved("unit", u))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Binding {
            nodes,
            values,
            models,
            units: IdVec::from_vec(units),
        })
    }

    fn unit(&self, model: ModelId, unit: UnitId) -> UnitId {
        self.units[model][unit]
    }

    fn layer(&self, at: LayerRef) -> LayerRef {
        LayerRef {
            model: self.models[at.model],
            layer: at.layer,
        }
    }
}

/// Maps each name through `lookup`, in table order.
fn bind<'a, I: EntityId, T: EntityId>(
    names: impl Iterator<Item = &'a str>,
    lookup: impl Fn(&'a str) -> Result<T, PlanReadError>,
) -> Result<IdVec<I, T>, PlanReadError> {
    names
        .map(lookup)
        .collect::<Result<Vec<T>, _>>()
        .map(IdVec::from_vec)
}

impl Plan {
    /// This plan, read with `names`, for `graph`: refused when it was made for another graph
    /// (fingerprints differ) or names something the graph lacks.
    pub fn resolve(self, names: &NameTable, graph: &Graph) -> Result<Plan, PlanReadError> {
        self.check_graph(graph)?;
        let b = Binding::new(names, graph)?;
        let Plan {
            config,
            nodes,
            saved,
            replay,
            units,
            memory,
            diagnostics,
            ..
        } = self;
        let bind_layers = |layers: Vec<LayerKeep>| -> Vec<LayerKeep> {
            layers
                .into_iter()
                .map(|l| LayerKeep {
                    units: l.units.iter().map(|&u| b.unit(l.at.model, u)).collect(),
                    at: b.layer(l.at),
                })
                .collect()
        };
        let layer_keep = bind_layers(config.layer_keep);
        let layer_offload = config
            .layer_offload
            .into_iter()
            .map(|l| LayerOffload {
                units: l.units.iter().map(|&u| b.unit(l.at.model, u)).collect(),
                at: b.layer(l.at),
                layer_input: l.layer_input,
            })
            .collect();
        Ok(Plan {
            config: super::Config {
                layer_keep,
                layer_offload,
                ..config
            },
            nodes: nodes
                .into_iter()
                .map(|n| NodeDecision {
                    node: b.nodes[n.node],
                    model: b.models[n.model],
                    unit: n.unit.map(|u| b.unit(n.model, u)),
                    ..n
                })
                .collect(),
            saved: saved
                .into_iter()
                .map(|s| SavedValue {
                    value: b.values[s.value],
                    alias_of: s.alias_of.map(|v| b.values[v]),
                    model: s.model.map(|m| b.models[m]),
                    ..s
                })
                .collect(),
            replay: replay
                .into_iter()
                .map(|r| Replay {
                    at: b.layer(r.at),
                    nodes: r.nodes.iter().map(|&n| b.nodes[n]).collect(),
                    before: b.nodes[r.before],
                    seconds: r.seconds,
                })
                .collect(),
            units: units
                .into_iter()
                .map(|u| UnitSummary {
                    unit: b.unit(u.model, u.unit),
                    model: b.models[u.model],
                    ..u
                })
                .collect(),
            memory: super::Memory {
                peak: memory.peak.map(|p| Peak {
                    node: b.nodes[p.node],
                    ..p
                }),
                ..memory
            },
            diagnostics: diagnostics
                .into_iter()
                .map(|d| Diagnostic {
                    unit: d.unit.map(|u| b.unit(d.model, u)),
                    model: b.models[d.model],
                    ..d
                })
                .collect(),
            ..self
        })
    }
}
