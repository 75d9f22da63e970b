//! The enumerations of a plan and their spellings, the one place that maps each variant to
//! the string the text output, the JSON and the protobuf carry (`"no-checkpoint"`).

/// An enumeration spelled as fixed strings: in every plan format, on the command line (its
/// options' possible values and their help) and in the Python API. [`spelled!`](crate::spelled)
/// implements it; the variant's doc comment is its help.
pub trait Spelled: Copy + Send + Sync + 'static {
    /// Every variant, in declaration order.
    const ALL: &'static [Self];
    /// The spelling.
    fn name(self) -> &'static str;
    /// The variant spelled `text`, if any.
    fn from_name(text: &str) -> Option<Self>;
    /// What the variant means: its doc comment, one line per line of the comment.
    fn help(self) -> &'static str;

    /// The spellings, comma-separated (for error messages).
    fn spellings() -> String {
        let names: Vec<&str> = Self::ALL.iter().map(|v| v.name()).collect();
        names.join(", ")
    }
}

/// Declares an enum whose variants are spelled as fixed strings (`Variant => "spelling"`),
/// with `ALL`, `name`, `from_name`, `Display` and [`Spelled`] (the variant's doc
/// comment as its help).
#[macro_export]
macro_rules! spelled {
    (@help) => { "" };
    (@help #[doc = $line:literal] $($rest:tt)*) => {
        concat!($line, "\n", $crate::spelled!(@help $($rest)*))
    };
    (@help #[$($other:tt)*] $($rest:tt)*) => { $crate::spelled!(@help $($rest)*) };
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            // Token trees, not `meta`: `@help` must look inside each attribute.
            $( $(#[$($vattr:tt)*])* $variant:ident => $text:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$($vattr)*])* $variant, )*
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The spelling in plans and messages.
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )*
                }
            }

            /// The variant spelled `text`, if any.
            pub fn from_name(text: &str) -> Option<$name> {
                match text {
                    $( $text => Some($name::$variant), )*
                    _ => None,
                }
            }
        }

        impl $crate::plan::Spelled for $name {
            const ALL: &'static [$name] = $name::ALL;

            fn name(self) -> &'static str {
                $name::name(self)
            }

            fn from_name(text: &str) -> Option<$name> {
                $name::from_name(text)
            }

            fn help(self) -> &'static str {
                match self {
                    $( $name::$variant => $crate::spelled!(@help $(#[$($vattr)*])*), )*
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

spelled! {
    /// What happens to a forward node's output.
    pub enum Decision {
        /// The output is kept resident for backward.
        Save => "save",
        /// The op re-runs in replay when backward needs its output.
        Recompute => "recompute",
        /// Not in a checkpointed layer: autograd saves what backward needs, nothing re-runs.
        NoCheckpoint => "no-checkpoint",
    }
}

spelled! {
    /// Why a forward node got its decision.
    pub enum Reason {
        /// Ran while an interval of a kept unit was open.
        KeptInterval => "kept-interval",
        /// Ran while no kept interval was open.
        OutsideKeptInterval => "outside-kept-interval",
        /// Has a mutable schema: its cached output could be overwritten before backward
        /// reads it, so it is never kept.
        Mutable => "mutable",
        /// A collective (or a device-to-host sync): re-runs in replay.
        Collective => "collective",
        /// A functional collective or device-to-host sync kept by `--collectives save`.
        SavedCollective => "saved-collective",
        /// Runs inside a compiled region: never reaches the per-op policy.
        Compiled => "compiled",
        /// A `checkpoint_record` point marker (an identity): recomputed, never kept.
        Marker => "marker",
        /// A view: recomputed from its saved base, never saved on its own.
        View => "view",
        /// Kept on its own by the budget solver (`--granularity op`).
        ChosenOp => "chosen-op",
        /// A random op (dropout) saved by `--random-ops save`, so replay never draws new random
        /// numbers.
        Random => "random",
        /// A random op that replays with the generator state forward saw (`--random-ops
        /// replay`).
        RandomReplayed => "random-replayed",
        /// Its interval keeps it, but forward writes its output in place later: a saved copy
        /// would be written twice by an executor that re-runs the writers, so it is recomputed
        /// and replays with them.
        WrittenInPlace => "written-in-place",
        /// Its layer is not selected by `--recompute-ratio`.
        LayerNotCheckpointed => "layer-not-checkpointed",
        /// Outside any decoder layer (embedding, head, loss).
        OutsideLayers => "outside-layers",
    }
}

spelled! {
    /// Why a value is resident for backward.
    pub enum SavedKind {
        /// The output of a kept op.
        Kept => "kept",
        /// A checkpointed layer's input (whole-layer checkpointing saves it).
        LayerInput => "layer-input",
        /// Made outside checkpointed layers: autograd saves it as usual.
        NotCheckpointed => "not-checkpointed",
        /// The output of a recomputed op that writes a resident tensor in place: replaying it
        /// would corrupt that tensor, so its output is saved instead.
        WritesResident => "writes-resident",
        /// The output of a recomputed op that reads a resident tensor which forward writes in
        /// place after it: a replay would read the written value, so its output is saved.
        ReadsOverwritten => "reads-overwritten",
        /// A recomputed tensor written in place by an op that cannot replay (it writes or reads
        /// resident tensors): it stays resident, holding the write.
        WrittenUnreplayably => "written-unreplayably",
        /// A parameter of the model: resident for the whole step anyway.
        Parameter => "parameter",
        /// A graph input other than a parameter (data, buffers, tangents).
        GraphInput => "graph-input",
    }
}

impl SavedKind {
    /// Activation memory (as opposed to parameters and inputs, which are resident anyway).
    pub fn is_activation(self) -> bool {
        matches!(
            self,
            SavedKind::Kept
                | SavedKind::LayerInput
                | SavedKind::NotCheckpointed
                | SavedKind::WritesResident
                | SavedKind::ReadsOverwritten
                | SavedKind::WrittenUnreplayably
        )
    }
}

spelled! {
    /// How bad a diagnostic is: an error rejects the configuration.
    pub enum Level {
        Error => "error",
        Warning => "warning",
        Info => "info",
    }
}

spelled! {
    /// What a diagnostic diagnoses (docs/diagnostics.md has one example of each).
    pub enum Code {
        InplaceInKeptInterval => "inplace-in-kept-interval",
        NoUnitsDeclared => "no-units-declared",
        MarkerMissing => "marker-missing",
        IntervalInert => "interval-inert",
        IntervalUnbalanced => "interval-unbalanced",
        IntervalOverlap => "interval-overlap",
        LayerCompiledAsOneRegion => "layer-compiled-as-one-region",
        NondeterministicReplay => "nondeterministic-replay",
        KeptOutputWrittenInPlace => "kept-output-written-in-place",
        RandomOpSaved => "random-op-saved",
        NoLayersAnnotated => "no-layers-annotated",
        EagerReplayUnfaithful => "eager-replay-unfaithful",
        RandomOpReplayed => "random-op-replayed",
        EagerCheckpointCostsMemory => "eager-checkpoint-costs-memory",
        OffloadAliasedOnDevice => "offload-aliased-on-device",
        OffloadWrittenInPlace => "offload-written-in-place",
        OffloadNoGap => "offload-no-gap",
        OffloadTooSmall => "offload-too-small",
        OffloadExceedsHostMemory => "offload-exceeds-host-memory",
    }
}

spelled! {
    /// Which pass of the step runs.
    pub enum Stage {
        Forward => "forward",
        Replay => "replay",
        Backward => "backward",
    }
}

spelled! {
    /// `--random-ops`: what happens to a random op (dropout) in a checkpointed layer, so that
    /// replay never draws other random numbers than forward did.
    #[derive(Default)]
    pub enum RandomOps {
        /// Its outputs are saved (what PyTorch's partitioner does by default): every executor
        /// honours it without restoring generator state.
        #[default]
        Save => "save",
        /// It replays with the generator state it saw in forward restored: the executor must
        /// restore it (the runtime does; eager checkpoint with `preserve_rng_state=True` does;
        /// torch.compile needs `functionalize_rng_ops`).
        Replay => "replay",
    }
}

spelled! {
    /// `--executor`: what runs the plan, which decides what a replay re-runs.
    #[derive(Default)]
    pub enum Executor {
        /// A graph executor (the runtime, `planner run`): replay re-runs exactly the ops whose
        /// outputs backward needs; a unit marker runs as the copy it is.
        #[default]
        Graph => "graph",
        /// Eager `torch.utils.checkpoint` with a selective policy: a layer's recompute re-runs
        /// its forward up to the last op backward reads, whatever those ops feed, and the
        /// policy caches every kept op's whole output tuple.
        Eager => "eager",
        /// The torch.compile planning stage: a graph executor (replay as `graph`) whose graphs
        /// hold no unit marker (the stage removes them once the plan is made: a marker's output
        /// is its input).
        Compiled => "compiled",
    }
}

spelled! {
    /// `--collectives`: whether functional collectives re-run in replay or are saved.
    #[derive(Default)]
    pub enum Collectives {
        /// Every collective re-runs in replay.
        #[default]
        Recompute => "recompute",
        /// Functional collectives and device-to-host syncs of routing counts are saved in
        /// checkpointed layers; mutating collectives never are.
        Save => "save",
    }
}

spelled! {
    /// `--optimizer`: the optimizer whose state the device holds beside the parameters.
    #[derive(Default)]
    pub enum Optimizer {
        /// AdamW: two moments per parameter element.
        #[default]
        AdamW => "adamw",
        /// SGD with momentum: one buffer per parameter element.
        Sgd => "sgd",
        /// No optimizer state (plain SGD, or the step counted elsewhere).
        None => "none",
    }
}

spelled! {
    /// `--optimizer-state-dtype`: the element type of the optimizer's state.
    #[derive(Default)]
    pub enum StateDtype {
        /// fp32, as mixed-precision training keeps it.
        #[default]
        F32 => "fp32",
        /// The parameter's own dtype, as `torch.optim` makes it (`zeros_like(param)`).
        Param => "param",
    }
}

spelled! {
    /// Where the device total peaks: during forward and backward, or in the optimizer step.
    pub enum DevicePhase {
        ForwardBackward => "forward-backward",
        OptimizerStep => "optimizer-step",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_reads_back_as_its_variant() {
        fn check<T: Copy + PartialEq + std::fmt::Debug>(
            all: &[T],
            name: fn(T) -> &'static str,
            from: fn(&str) -> Option<T>,
        ) {
            for &v in all {
                assert_eq!(from(name(v)), Some(v), "{v:?}");
            }
            assert_eq!(from("no-such-spelling"), None);
        }
        check(Decision::ALL, Decision::name, Decision::from_name);
        check(Reason::ALL, Reason::name, Reason::from_name);
        check(SavedKind::ALL, SavedKind::name, SavedKind::from_name);
        check(Level::ALL, Level::name, Level::from_name);
        check(Code::ALL, Code::name, Code::from_name);
        check(Stage::ALL, Stage::name, Stage::from_name);
        check(Collectives::ALL, Collectives::name, Collectives::from_name);
        check(RandomOps::ALL, RandomOps::name, RandomOps::from_name);
        check(Executor::ALL, Executor::name, Executor::from_name);
        check(Optimizer::ALL, Optimizer::name, Optimizer::from_name);
        check(StateDtype::ALL, StateDtype::name, StateDtype::from_name);
        check(DevicePhase::ALL, DevicePhase::name, DevicePhase::from_name);
    }

    #[test]
    fn a_variants_help_is_its_doc_comment_without_other_attributes() {
        // `Save` carries `#[default]` after its doc comment: skipped, not part of the help.
        assert_eq!(
            Spelled::help(RandomOps::Save),
            " Its outputs are saved (what PyTorch's partitioner does by default): every executor\n \
             honours it without restoring generator state.\n"
        );
        assert_eq!(
            Spelled::help(Collectives::Save),
            " Functional collectives and device-to-host syncs of routing counts are saved in\n \
             checkpointed layers; mutating collectives never are.\n"
        );
        assert_eq!(Spelled::help(DevicePhase::OptimizerStep), "");
    }
}
