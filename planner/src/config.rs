//! What the user asked for, resolved against the graph's models before any
//! planning work.

use std::collections::{BTreeMap, BTreeSet};

use ir::{
    plan::{Collectives, Executor, Keep, LayerRef, Offload, RandomOps, Training},
    Graph, IdVec, Model, ModelId, NodeId, UnitId,
};
use thiserror::Error;

/// Parses the `--keep` values: `none`, `all`, or unit names (case-insensitive, repeats
/// ignored). An empty list is `none`; an empty name (`--keep ""`, `a,,b`) is an error, not
/// a silent `none`.
pub fn parse_keep(values: &[String]) -> Result<Keep, ConfigError> {
    let names = unit_names(values)?;
    match names.as_slice() {
        [] => Ok(Keep::Nothing),
        [one] if one == "NONE" => Ok(Keep::Nothing),
        [one] if one == "ALL" => Ok(Keep::All),
        _ if names.iter().any(|n| n == "NONE" || n == "ALL") => {
            Err(ConfigError::MixedKeep { values: names })
        }
        _ => Ok(Keep::Units(names)),
    }
}

/// Parses the `--offload` values: unit names, as `--keep` reads them (case-insensitive,
/// comma-separated, repeats ignored, no empty name).
pub fn parse_offload_units(values: &[String]) -> Result<Vec<String>, ConfigError> {
    unit_names(values).map_err(|e| match e {
        ConfigError::EmptyUnit { value } => ConfigError::EmptyOffloadUnit { value },
        other => other,
    })
}

/// Upper-case unit names from comma-separated values, deduplicated in the order given; an
/// empty name is [`ConfigError::EmptyUnit`].
fn unit_names(values: &[String]) -> Result<Vec<String>, ConfigError> {
    if let Some(value) = values
        .iter()
        .find(|v| v.split(',').any(|name| name.trim().is_empty()))
    {
        return Err(ConfigError::EmptyUnit {
            value: value.clone(),
        });
    }
    let mut seen = rustc_hash::FxHashSet::default();
    Ok(values
        .iter()
        .flat_map(|v| v.split(','))
        .map(|v| v.trim().to_ascii_uppercase())
        .filter(|v| seen.insert(v.clone()))
        .collect())
}

/// Everything that shapes a plan besides the graph.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanConfig {
    pub keep: Keep,
    /// Layers with index `< floor(ratio × num_layers)` of each model are checkpointed.
    pub recompute_ratio: f64,
    pub collectives: Collectives,
    pub random_ops: RandomOps,
    pub executor: Executor,
    /// The training state the device total counts.
    pub training: Training,
    /// The saved values to move to host memory between forward and backward.
    pub offload: Offload,
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            keep: Keep::Nothing,
            recompute_ratio: 1.0,
            collectives: Collectives::Recompute,
            random_ops: RandomOps::Save,
            executor: Executor::Graph,
            training: Training::default(),
            offload: Offload::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error(
        "unknown-unit: unknown unit {}; this graph's models declare: {}",
        quoted(unknown),
        list_or_none(valid)
    )]
    UnknownUnit {
        unknown: Vec<String>,
        valid: Vec<String>,
    },
    #[error("--keep takes `none`, `all` or a list of units, not a mix: {}", values.join(","))]
    MixedKeep { values: Vec<String> },
    #[error(
        "--keep takes `none`, `all` or unit names, not an empty name: {}",
        empty_unit(value)
    )]
    EmptyUnit { value: String },
    #[error("--offload takes unit names, not an empty name: {}", empty_unit(value))]
    EmptyOffloadUnit { value: String },
    #[error(
        "--offload names {}, which --keep does not keep: offload moves what a kept unit saves to \
         the host (keep the unit too, or offload by kind with --offload-kinds)",
        quoted(units)
    )]
    OffloadNotKept { units: Vec<String> },
    #[error("--recompute-ratio must be between 0 and 1, got {ratio}")]
    Ratio { ratio: String },
    #[error("not a choices file: {reason} (expected the JSON of a `pareto` point or of a plan, with `layer_keep`)")]
    ChoicesFormat { reason: String },
    #[error("the choices name {what}, which this graph does not have")]
    ChoicesUnknown { what: String },
    #[error("the choices offload `{unit}` in layer {layer} of model `{model}`, which that layer does not keep: offload moves what a kept unit saves (keep it there too)")]
    ChoicesOffloadNotKept {
        model: String,
        layer: u32,
        unit: String,
    },
    #[error("the choices offload {units} in layer {layer} of model `{model}`, which is not checkpointed (layers from {checkpointed} on are not, by --recompute-ratio): its values are saved as they are and nothing there is a kept unit's or a layer input to move")]
    ChoicesOffloadNotCheckpointed {
        model: String,
        layer: u32,
        units: String,
        checkpointed: u32,
    },
}

fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where [`ConfigError::EmptyUnit`]'s value has its empty name.
fn empty_unit(value: &str) -> String {
    if value.trim().is_empty() {
        "the value is empty".to_owned()
    } else {
        format!("`{}` has one", ir::display::name(value))
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "no units".to_owned()
    } else {
        names.join(", ")
    }
}

/// Checks `--recompute-ratio`.
pub fn check_ratio(ratio: f64) -> Result<f64, ConfigError> {
    if (0.0..=1.0).contains(&ratio) {
        Ok(ratio)
    } else {
        Err(ConfigError::Ratio {
            ratio: ratio.to_string(),
        })
    }
}

/// The configuration resolved per model: which of its units are kept and which of its layers
/// are checkpointed.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// Per model, the units `--keep` keeps in its layers.
    pub kept_units: IdVec<ModelId, Vec<UnitId>>,
    /// Per-layer choices (the budget solver's) that replace the model's kept units there.
    pub layer_units: BTreeMap<LayerRef, Vec<UnitId>>,
    /// Per model, layers `< checkpointed_layers` are checkpointed.
    pub checkpointed_layers: IdVec<ModelId, u32>,
    /// Single ops the budget solver keeps (`--granularity op`), interval or not.
    pub chosen_ops: BTreeSet<NodeId>,
    /// Per model, the kept units whose saved values `--offload` moves to the host.
    pub offload_units: IdVec<ModelId, Vec<UnitId>>,
    /// Per-layer offload choices (the budget solver's, or `--choices`) that replace the
    /// model's offloaded units there.
    pub layer_offload: BTreeMap<LayerRef, Vec<UnitId>>,
    /// Layers whose layer inputs (their outputs, which the next checkpointed layer saves) go
    /// to the host, by a per-layer choice (the budget solver's, or `--choices`), besides
    /// `--offload-kinds layer-input`, which moves every layer's.
    pub layer_offload_inputs: BTreeSet<LayerRef>,
}

impl Resolved {
    pub fn is_checkpointed(&self, model: ModelId, layer: Option<u32>) -> bool {
        layer.is_some_and(|l| l < self.checkpointed_layers[model])
    }

    /// The units kept in `layer` of `model`.
    pub fn kept_at(&self, at: LayerRef) -> &[UnitId] {
        self.layer_units
            .get(&at)
            .unwrap_or(&self.kept_units[at.model])
    }

    /// Replaces the kept units of single layers.
    pub fn with_layer_units(mut self, layer_units: BTreeMap<LayerRef, Vec<UnitId>>) -> Self {
        self.layer_units = layer_units;
        self
    }

    /// The kept units whose saved values go to the host in `layer` of `model`.
    pub fn offloaded_at(&self, at: LayerRef) -> &[UnitId] {
        self.layer_offload
            .get(&at)
            .unwrap_or(&self.offload_units[at.model])
    }

    /// Whether a per-layer choice moves the layer inputs `layer` of `model` makes.
    pub fn offloads_input_of(&self, at: LayerRef) -> bool {
        self.layer_offload_inputs.contains(&at)
    }

    /// Whether a unit's saved values, or a layer's inputs by a per-layer choice, go to the
    /// host anywhere.
    pub fn offloads_per_unit_or_layer(&self) -> bool {
        self.offload_units.values().any(|units| !units.is_empty())
            || self.layer_offload.values().any(|units| !units.is_empty())
            || !self.layer_offload_inputs.is_empty()
    }

    /// Replaces the offloaded units of single layers, and the layers whose inputs go to the
    /// host.
    pub fn with_layer_offload(
        mut self,
        layer_offload: BTreeMap<LayerRef, Vec<UnitId>>,
        inputs: BTreeSet<LayerRef>,
    ) -> Self {
        self.layer_offload = layer_offload;
        self.layer_offload_inputs = inputs;
        self
    }

    /// Applies a `--choices` file: its layers' kept units, then their offloaded units, each of
    /// which the layer must keep and checkpoint (a unit not kept, or kept in a layer that is
    /// not checkpointed, saves nothing of its own to move).
    pub fn with_choices(self, graph: &Graph, choices: Choices) -> Result<Self, ConfigError> {
        let resolved = self.with_layer_units(choices.keep);
        for &at in &choices.offload_inputs {
            resolved.check_offloads_in_checkpointed(graph, at, "its layer inputs".to_owned())?;
        }
        for (&at, units) in &choices.offload {
            if !units.is_empty() {
                let model = graph.model(at.model);
                let names: Vec<String> = units
                    .iter()
                    .map(|&u| format!("`{}`", model.units[u].name))
                    .collect();
                resolved.check_offloads_in_checkpointed(graph, at, names.join(", "))?;
            }
            let kept = resolved.kept_at(at);
            if let Some(&unit) = units.iter().find(|u| !kept.contains(u)) {
                let model = graph.model(at.model);
                return Err(ConfigError::ChoicesOffloadNotKept {
                    unit: model.units[unit].name.clone(),
                    model: model.name.clone(),
                    layer: at.layer,
                });
            }
        }
        Ok(resolved.with_layer_offload(choices.offload, choices.offload_inputs))
    }

    /// A per-layer choice offloads `what` in `at`: refused where the layer is not checkpointed
    /// (its values are saved as they are; nothing there is a kept unit's or a layer input).
    fn check_offloads_in_checkpointed(
        &self,
        graph: &Graph,
        at: LayerRef,
        what: String,
    ) -> Result<(), ConfigError> {
        if self.is_checkpointed(at.model, Some(at.layer)) {
            return Ok(());
        }
        Err(ConfigError::ChoicesOffloadNotCheckpointed {
            model: graph.model(at.model).name.clone(),
            layer: at.layer,
            units: what,
            checkpointed: self.checkpointed_layers[at.model],
        })
    }

    /// Keeps these ops too, wherever they are (when eligible: eager, not mutable, ...).
    pub fn with_chosen_ops(mut self, chosen_ops: BTreeSet<NodeId>) -> Self {
        self.chosen_ops = chosen_ops;
        self
    }

    /// The units of `model` kept in at least one of its layers, sorted.
    pub fn kept_anywhere(&self, model: ModelId) -> Vec<UnitId> {
        let mut units = self.kept_units[model].clone();
        let layers = LayerRef { model, layer: 0 }..=LayerRef {
            model,
            layer: u32::MAX,
        };
        for (_, layer_units) in self.layer_units.range(layers) {
            units.extend(layer_units);
        }
        units.sort_unstable();
        units.dedup();
        units
    }
}

/// Resolves `config` against `graph`; an unknown unit is an error naming the valid ones.
pub fn resolve(graph: &Graph, config: &PlanConfig) -> Result<Resolved, ConfigError> {
    if let Keep::Units(requested) = &config.keep {
        check_declared(graph, requested)?;
    }
    check_declared(graph, &config.offload.units)?;
    check_offload_kept(&config.keep, &config.offload.units)?;
    let kept_units = IdVec::from_vec(
        graph
            .models()
            .values()
            .map(|model| kept_units_of(model, &config.keep))
            .collect(),
    );
    let checkpointed_layers = IdVec::from_vec(
        graph
            .models()
            .values()
            .map(|m| checkpointed_layer_count(config.recompute_ratio, m.num_layers))
            .collect(),
    );
    let offload = Keep::Units(config.offload.units.clone());
    let offload_units = IdVec::from_vec(
        graph
            .models()
            .values()
            .map(|model| kept_units_of(model, &offload))
            .collect(),
    );
    Ok(Resolved {
        kept_units,
        layer_units: BTreeMap::new(),
        checkpointed_layers,
        chosen_ops: BTreeSet::new(),
        offload_units,
        layer_offload: BTreeMap::new(),
        layer_offload_inputs: BTreeSet::new(),
    })
}

/// Every name in `requested` is a unit some model declares.
fn check_declared(graph: &Graph, requested: &[String]) -> Result<(), ConfigError> {
    let valid = declared_units(graph);
    let unknown: Vec<String> = requested
        .iter()
        .filter(|u| !valid.contains(u))
        .cloned()
        .collect();
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::UnknownUnit { unknown, valid })
    }
}

/// Every unit `--offload` names is one `--keep` keeps: a unit not kept saves nothing to move.
fn check_offload_kept(keep: &Keep, offload: &[String]) -> Result<(), ConfigError> {
    let kept = |unit: &String| match keep {
        Keep::Nothing => false,
        Keep::All => true,
        Keep::Units(units) => units.contains(unit),
    };
    let units: Vec<String> = offload.iter().filter(|u| !kept(u)).cloned().collect();
    if units.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::OffloadNotKept { units })
    }
}

/// The units of `model` that `keep` selects (names match case-insensitively).
pub fn kept_units_of(model: &Model, keep: &Keep) -> Vec<UnitId> {
    let kept = |name: &str| match keep {
        Keep::Nothing => false,
        Keep::All => true,
        Keep::Units(units) => units.contains(&name.to_ascii_uppercase()),
    };
    model
        .units
        .iter()
        .filter(|(_, u)| kept(&u.name))
        .map(|(id, _)| id)
        .collect()
}

/// `floor(ratio × num_layers)`: the first layers of each model, as Megatron-style `recompute_ratio`
/// options select them.
pub fn checkpointed_layer_count(ratio: f64, num_layers: u32) -> u32 {
    // ratio is in [0, 1], so the product is in [0, num_layers].
    (ratio * f64::from(num_layers)).floor() as u32
}

/// Per-layer choices a `--choices` file states: the units each listed layer keeps, the kept
/// units each listed layer offloads, and the layers whose layer inputs it offloads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Choices {
    pub keep: BTreeMap<LayerRef, Vec<UnitId>>,
    pub offload: BTreeMap<LayerRef, Vec<UnitId>>,
    pub offload_inputs: BTreeSet<LayerRef>,
}

/// Per-layer choices from JSON: a `pareto --format json` point, or a plan, whose `layer_keep`
/// (top level, or under `config`) lists `{"model", "layer", "keep": [units]}` and whose
/// optional `layer_offload` lists `{"model", "layer", "offload": [units], "layer_input":
/// bool}` (`layer_input` optional, false by default). Unit names match case-insensitively;
/// every model, layer and unit must exist.
pub fn parse_choices(graph: &Graph, json: &[u8]) -> Result<Choices, ConfigError> {
    let format = |reason: String| ConfigError::ChoicesFormat { reason };
    let doc: serde_json::Value = serde_json::from_slice(json).map_err(|e| format(e.to_string()))?;
    let field = |name: &str| {
        doc.get(name)
            .or_else(|| doc.get("config").and_then(|c| c.get(name)))
    };
    let keep: Vec<ChoiceEntry> = serde_json::from_value(
        field("layer_keep")
            .ok_or_else(|| format("no `layer_keep`".to_owned()))?
            .clone(),
    )
    .map_err(|e| format(e.to_string()))?;
    let offload: Vec<OffloadEntry> = match field("layer_offload") {
        Some(list) => serde_json::from_value(list.clone()).map_err(|e| format(e.to_string()))?,
        None => Vec::new(),
    };
    let offload_inputs: Vec<bool> = offload.iter().map(|entry| entry.layer_input).collect();
    let offload: Vec<(LayerRef, Vec<UnitId>)> = offload
        .into_iter()
        .map(|entry| ChoiceEntry::from(entry).resolve(graph))
        .collect::<Result<_, _>>()?;
    let keep: Vec<(LayerRef, Vec<UnitId>)> = keep
        .into_iter()
        .map(|entry| entry.resolve(graph))
        .collect::<Result<_, _>>()?;
    Ok(Choices {
        keep: once_per_layer(graph, keep, "layer_keep")?,
        offload_inputs: offload
            .iter()
            .zip(offload_inputs)
            .filter(|(_, input)| *input)
            .map(|((at, _), _)| *at)
            .collect(),
        offload: once_per_layer(graph, offload, "layer_offload")?,
    })
}

/// `layers` by layer, each listed once in `field`.
fn once_per_layer(
    graph: &Graph,
    layers: Vec<(LayerRef, Vec<UnitId>)>,
    field: &str,
) -> Result<BTreeMap<LayerRef, Vec<UnitId>>, ConfigError> {
    let mut by_layer = BTreeMap::new();
    for (at, units) in layers {
        if by_layer.insert(at, units).is_some() {
            return Err(ConfigError::ChoicesFormat {
                reason: format!(
                    "`{field}` lists layer {} of model `{}` twice",
                    at.layer,
                    graph.model(at.model).name
                ),
            });
        }
    }
    Ok(by_layer)
}

/// One layer's kept units as the JSON spells them.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ChoiceEntry {
    model: String,
    layer: u32,
    keep: Vec<String>,
}

/// What one layer offloads as the JSON spells it: kept units, and its layer inputs.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OffloadEntry {
    model: String,
    layer: u32,
    #[serde(default)]
    offload: Vec<String>,
    #[serde(default)]
    layer_input: bool,
}

impl From<OffloadEntry> for ChoiceEntry {
    fn from(e: OffloadEntry) -> Self {
        ChoiceEntry {
            model: e.model,
            layer: e.layer,
            keep: e.offload,
        }
    }
}

impl ChoiceEntry {
    fn resolve(self, graph: &Graph) -> Result<(LayerRef, Vec<UnitId>), ConfigError> {
        let unknown = |what: String| ConfigError::ChoicesUnknown { what };
        let model = graph
            .model_by_name(&self.model)
            .ok_or_else(|| unknown(format!("model `{}`", self.model)))?;
        let declared = graph.model(model);
        if self.layer >= declared.num_layers {
            return Err(unknown(format!(
                "layer {} of model `{}` ({} layers)",
                self.layer, self.model, declared.num_layers
            )));
        }
        let units = self
            .keep
            .iter()
            .map(|name| {
                declared
                    .units
                    .iter()
                    .find(|(_, u)| u.name.eq_ignore_ascii_case(name))
                    .map(|(id, _)| id)
                    .ok_or_else(|| unknown(format!("unit `{name}` of model `{}`", self.model)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((
            LayerRef {
                model,
                layer: self.layer,
            },
            units,
        ))
    }
}

/// Upper-case unit names declared by any model of the graph, sorted.
pub fn declared_units(graph: &Graph) -> Vec<String> {
    let mut units: Vec<String> = graph
        .models()
        .values()
        .flat_map(|m| m.units.values().map(|u| u.name.to_ascii_uppercase()))
        .collect();
    units.sort();
    units.dedup();
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keep(values: &[&str]) -> Result<Keep, ConfigError> {
        parse_keep(&values.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn r2_keep_is_tri_state_and_case_insensitive() {
        assert_eq!(keep(&[]), Ok(Keep::Nothing));
        assert_eq!(keep(&["none"]), Ok(Keep::Nothing));
        assert_eq!(keep(&["All"]), Ok(Keep::All));
        assert_eq!(
            keep(&["save_dsa_indexer,SAVE_attn", "save_attn"]),
            Ok(Keep::Units(vec![
                "SAVE_DSA_INDEXER".into(),
                "SAVE_ATTN".into()
            ]))
        );
        assert!(matches!(
            keep(&["all", "save_attn"]),
            Err(ConfigError::MixedKeep { .. })
        ));
    }

    #[test]
    fn an_empty_keep_name_is_an_error_not_none() {
        for values in [
            &[""][..],
            &[" "],
            &["save_attn,"],
            &["save_attn,,save_mlp"],
            &["all", ""],
        ] {
            assert!(
                matches!(keep(values), Err(ConfigError::EmptyUnit { .. })),
                "{values:?}"
            );
        }
        assert_eq!(
            keep(&[""]).unwrap_err().to_string(),
            "--keep takes `none`, `all` or unit names, not an empty name: the value is empty"
        );
    }

    #[test]
    fn r3_ratio_selects_the_floor_of_ratio_times_layers() {
        assert_eq!(checkpointed_layer_count(1.0, 61), 61);
        assert_eq!(checkpointed_layer_count(0.5, 61), 30);
        assert_eq!(checkpointed_layer_count(0.0, 61), 0);
        assert_eq!(checkpointed_layer_count(0.99, 2), 1);
        assert!(check_ratio(1.5).is_err());
        assert!(check_ratio(f64::NAN).is_err());
    }
}
