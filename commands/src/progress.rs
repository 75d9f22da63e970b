//! The progress of long searches on a terminal: a bar when the number of candidate plans is
//! known, a counter otherwise. Silent when stderr is not a terminal or with `--quiet`.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use planner::progress::Progress;

/// A progress bar on stderr, cleared when dropped.
pub struct Bar(Option<ProgressBar>);

impl Bar {
    pub fn new(quiet: bool) -> Bar {
        let shown = !quiet && std::io::stderr().is_terminal();
        Bar(shown.then(|| ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())))
    }
}

impl Progress for Bar {
    fn stage(&self, what: &str, total: Option<u64>) {
        let Some(bar) = &self.0 else { return };
        bar.reset();
        bar.set_length(total.unwrap_or(0));
        let template = match total {
            Some(_) => "{msg}: {bar:30} {pos}/{len} plans, {elapsed}",
            None => "{msg}: {pos} plans, {elapsed}",
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        bar.set_message(what.to_owned());
    }

    fn advance(&self) {
        if let Some(bar) = &self.0 {
            bar.inc(1);
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}
