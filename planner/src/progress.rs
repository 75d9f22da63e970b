//! Progress of long searches (`--budget`, `pareto`), reported to whoever shows it: the CLI
//! draws a bar on a terminal; a library caller may ignore it.

/// Receives the progress of a search. Candidates are planned on several threads at once.
pub trait Progress: Sync {
    /// A new stage starts: `what` it does, and how many candidate plans it will simulate when
    /// that is known in advance.
    fn stage(&self, what: &str, total: Option<u64>);
    /// One more candidate plan was simulated.
    fn advance(&self);
    /// Whether the caller wants the search stopped (Ctrl-C in Python): a search asks before
    /// each candidate plan and then ends with [`crate::budget::BudgetError::Interrupted`].
    fn interrupted(&self) -> bool {
        false
    }
}

/// Progress nobody watches.
pub struct Silent;

impl Progress for Silent {
    fn stage(&self, _: &str, _: Option<u64>) {}
    fn advance(&self) {}
}
