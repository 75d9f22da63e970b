//! The search for the peak / replay-time frontier over per-layer options, every candidate
//! simulated exactly by the composed model ([`crate::compose`]).
//!
//! Candidates, each a choice of one option per layer:
//! - every combination, when there are at most [`EXHAUSTIVE_LIMIT`]: the frontier is exact;
//! - else a greedy path from keeping nothing: each layer climbs the lower convex hull of its
//!   options (kept bytes against replay seconds), and the next step taken is the one with
//!   the most replay time saved per byte of *simulated* peak it adds (steps that add nothing
//!   first), re-simulated lazily when the state has changed since it was ranked;
//! - the choices of a multiple-choice knapsack over the linear peak model at evenly spaced
//!   headrooms (one solved dynamic program);
//! - every uniform choice (`--keep` of a set of unit names);
//! - between two frontier points further apart than the density asks, the choices on the way
//!   from one to the other, one layer at a time, and single-layer steps from either end that
//!   land in the gap and beat its slower end (repeated on the narrower gaps that leaves).
//!
//! The frontier keeps the candidates no other beats on both peak and replay time, thinned so
//! that consecutive points are at most `1/steps` of the peak range apart (where candidates
//! exist) and every uniform choice on it stays.

use std::{cmp::Ordering, collections::BinaryHeap};

use crate::compose::{Composer, Contribution, Model, Ticks};

/// Up to this many per-layer combinations, every one is simulated: the frontier is exact.
pub const EXHAUSTIVE_LIMIT: u64 = 1024;
/// Quantisation of the headroom for the knapsack.
pub const BUCKETS: u64 = 4096;
/// At most this many cells (layers times capacity steps) in the knapsack's table: deep graphs
/// get fewer steps, which their many small layers do not miss.
const KNAPSACK_CELLS: u64 = 1 << 22;
/// Re-simulations one greedy step may make before it takes the best step it has seen.
const LAZY_TRIES: usize = 8;
/// Simulations one way of filling one gap of the frontier may make.
pub const FILL_TRIES: usize = 512;

/// A candidate answer: one option per layer, its simulated peak and replay time.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub peak: u64,
    pub time: Ticks,
    pub choice: Vec<u8>,
    /// A uniform choice (what `--keep` of some unit names gives): never thinned away.
    pub uniform: bool,
}

impl Candidate {
    /// At least as good on both axes and better on one.
    pub fn dominates(&self, other: &Candidate) -> bool {
        self.peak <= other.peak
            && self.time <= other.time
            && (self.peak < other.peak || self.time < other.time)
    }
}

/// The candidates no other beats, by increasing peak (and decreasing time).
#[derive(Default)]
struct Archive(Vec<Candidate>);

impl Archive {
    /// Keeps `candidate` unless another beats or equals it; drops those it beats. Peaks
    /// strictly increase along the archive and times strictly decrease.
    fn offer(&mut self, candidate: Candidate) {
        let list = &mut self.0;
        let at = list.partition_point(|c| c.peak <= candidate.peak);
        // Of the points with a peak at most the candidate's, the last is the fastest.
        let mut start = at;
        if let Some(before) = at.checked_sub(1).map(|k| &mut list[k]) {
            if before.peak == candidate.peak && before.time == candidate.time {
                before.uniform |= candidate.uniform;
                return;
            }
            if before.time <= candidate.time {
                return;
            }
            if before.peak == candidate.peak {
                start -= 1;
            }
        }
        let end = at
            + list[at..]
                .iter()
                .take_while(|c| c.time >= candidate.time)
                .count();
        list.splice(start..end, std::iter::once(candidate));
    }
}

/// Explores the options of `model`'s layers.
pub struct Explorer<'m> {
    model: &'m Model,
    composer: Composer<'m>,
    archive: Archive,
}

impl<'m> Explorer<'m> {
    pub fn new(model: &'m Model) -> Explorer<'m> {
        let mut explorer = Explorer {
            model,
            composer: Composer::new(model),
            archive: Archive::default(),
        };
        explorer.offer(false);
        explorer
    }

    /// Per-layer combinations: the product of the option counts.
    pub fn combinations(&self) -> u64 {
        self.model
            .options
            .iter()
            .fold(1u64, |acc, o| acc.saturating_mul(o.len() as u64))
    }

    /// Offers the composer's current choice, if every layer allows its option.
    fn offer(&mut self, uniform: bool) {
        let choice = self.composer.choice();
        if !self.model.allowed(choice) {
            return;
        }
        self.archive.offer(Candidate {
            peak: self.composer.peak(),
            time: self.model.time(choice),
            choice: choice.to_vec(),
            uniform,
        });
    }

    /// Simulates `choice` and offers it.
    pub fn visit(&mut self, choice: &[u8], uniform: bool) {
        self.composer.set(choice);
        self.offer(uniform);
    }

    /// Every combination, in mixed-radix order.
    pub fn every_combination(&mut self) {
        let radix: Vec<usize> = self.model.options.iter().map(Vec::len).collect();
        let total: usize = radix.iter().product();
        for mut k in 0..total {
            let choice: Vec<u8> = radix
                .iter()
                .map(|&r| {
                    let o = k % r;
                    k /= r;
                    o as u8
                })
                .collect();
            self.visit(&choice, false);
        }
    }

    /// The greedy path from the current choice (see the module documentation), offering
    /// every choice on it.
    pub fn greedy_path(&mut self) {
        let mut heap: BinaryHeap<Step> = BinaryHeap::new();
        let mut state = 0u64;
        for layer in 0..self.model.layers() {
            if let Some(step) = self.step_of(layer, state) {
                heap.push(step);
            }
        }
        let mut tries = 0;
        while let Some(step) = heap.pop() {
            let step = if step.state == state {
                step
            } else {
                // Ranked before the last step changed the peak: rank it again, and take it if
                // it still beats the best other step (or after a few tries, whatever it is).
                let Some(again) = self.step_of(step.layer, state) else {
                    continue;
                };
                tries += 1;
                if tries < LAZY_TRIES && heap.peek().is_some_and(|top| again < *top) {
                    heap.push(again);
                    continue;
                }
                again
            };
            self.composer.apply(step.layer, step.option);
            self.offer(false);
            state += 1;
            tries = 0;
            if let Some(next) = self.step_of(step.layer, state) {
                heap.push(next);
            }
        }
    }

    /// The next step of `layer` from its current option, ranked by simulating it at the
    /// current state: replay time saved per byte of peak added, a step that adds nothing
    /// first.
    fn step_of(&mut self, layer: usize, state: u64) -> Option<Step> {
        let options = &self.model.options[layer];
        let from = usize::from(self.composer.choice()[layer]);
        let option = hull_step(options, from)?;
        let peak = self.composer.peak();
        let after = self.composer.try_option(layer, option as u8);
        let gain = options[from].seconds - options[option].seconds;
        let key = match after.checked_sub(peak).filter(|&added| added > 0) {
            Some(added) => Key::Ratio(gain / added as f64),
            None => Key::Free(gain),
        };
        Some(Step {
            key,
            layer,
            option: option as u8,
            state,
        })
    }

    /// The choices between `from` and `to`, one differing layer at a time, by replay time
    /// saved per kept byte.
    pub fn between(&mut self, from: &[u8], to: &[u8]) {
        let options = &self.model.options;
        let mut differing: Vec<(f64, usize)> = from
            .iter()
            .zip(to)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(l, (&a, &b))| {
                let (a, b) = (&options[l][usize::from(a)], &options[l][usize::from(b)]);
                (per_byte(a, b), l)
            })
            .collect();
        differing.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        self.composer.set(from);
        for (_, l) in differing {
            self.composer.apply(l, to[l]);
            self.offer(false);
        }
    }

    /// Looks for choices inside the gap between frontier points `a` and `b` (`a` keeps
    /// less): from `b`, single-layer steps down that land in the gap and still beat `a`'s
    /// replay time, cheapest in time per kept byte first; then from `a`, steps up that land in
    /// the gap. At most [`FILL_TRIES`] simulations each way.
    pub fn fill(&mut self, a: &Candidate, b: &Candidate) {
        self.climb(b, a, Direction::Down);
        self.climb(a, b, Direction::Up);
    }

    fn climb(&mut self, from: &Candidate, other: &Candidate, direction: Direction) {
        let (low, high) = match direction {
            Direction::Down => (other.peak, from.peak),
            Direction::Up => (from.peak, other.peak),
        };
        let slowest = match direction {
            Direction::Down => other.time,
            Direction::Up => from.time,
        };
        self.composer.set(&from.choice);
        let mut now = from.time;
        let mut tries = 0;
        'step: while tries < FILL_TRIES {
            for (layer, option) in self.moves(direction) {
                if tries == FILL_TRIES {
                    break 'step;
                }
                tries += 1;
                let peak = self.composer.try_option(layer, option);
                let options = &self.model.options[layer];
                let before = usize::from(self.composer.choice()[layer]);
                let time = now - options[before].ticks + options[usize::from(option)].ticks;
                if low < peak && peak < high && time < slowest {
                    self.composer.apply(layer, option);
                    self.offer(false);
                    now = time;
                    continue 'step;
                }
            }
            break;
        }
    }

    /// Every single-layer step from the current choice in `direction` (to fewer kept bytes
    /// down, to less replay time up), the cheapest in time per byte first.
    fn moves(&self, direction: Direction) -> Vec<(usize, u8)> {
        let mut moves: Vec<(f64, usize, u8)> = Vec::new();
        for (l, options) in self.model.options.iter().enumerate() {
            let now = &options[usize::from(self.composer.choice()[l])];
            for (o, option) in options.iter().enumerate() {
                let ok = option.allowed
                    && match direction {
                        Direction::Down => option.kept_bytes < now.kept_bytes,
                        Direction::Up => option.seconds < now.seconds,
                    };
                if ok {
                    let cost = match direction {
                        Direction::Down => -per_byte(option, now),
                        Direction::Up => -per_byte(now, option),
                    };
                    moves.push((cost, l, o as u8));
                }
            }
        }
        moves.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        moves.into_iter().map(|(_, l, o)| (l, o)).collect()
    }

    /// The frontier found so far, thinned to `steps` (see the module documentation).
    pub fn frontier(&self, steps: u64) -> Vec<Candidate> {
        thin(&self.archive.0, steps)
    }

    /// Every candidate no other beats.
    pub fn unthinned(&self) -> &[Candidate] {
        &self.archive.0
    }
}

/// Which way a search moves: to keeping more (less replay time), or less (fewer bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Up,
    Down,
}

/// How good a greedy step is: steps that add no peak first (by replay time saved), then by
/// replay time saved per byte of peak added.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Key {
    Ratio(f64),
    Free(f64),
}

impl Key {
    fn order(&self, other: &Key) -> Ordering {
        match (self, other) {
            (Key::Free(a), Key::Free(b)) | (Key::Ratio(a), Key::Ratio(b)) => a.total_cmp(b),
            (Key::Free(_), Key::Ratio(_)) => Ordering::Greater,
            (Key::Ratio(_), Key::Free(_)) => Ordering::Less,
        }
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<Ordering> {
        Some(self.order(other))
    }
}

/// A layer's next option on the greedy path, ranked at state `state`.
#[derive(Debug, Clone, Copy)]
struct Step {
    key: Key,
    layer: usize,
    option: u8,
    state: u64,
}

impl PartialEq for Step {
    fn eq(&self, other: &Step) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Step {}

impl PartialOrd for Step {
    fn partial_cmp(&self, other: &Step) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Step {
    /// The best key first; on a tie, the first layer.
    fn cmp(&self, other: &Step) -> Ordering {
        self.key
            .order(&other.key)
            .then(other.layer.cmp(&self.layer))
            .then(other.option.cmp(&self.option))
    }
}

/// Replay seconds saved per kept byte going from option `a` to `b` (infinite when no bytes
/// are added).
fn per_byte(a: &Contribution, b: &Contribution) -> f64 {
    let gain = a.seconds - b.seconds;
    match b.kept_bytes.saturating_sub(a.kept_bytes) {
        0 => f64::INFINITY * gain.signum(),
        bytes => gain / bytes as f64,
    }
}

/// The next option on the lower convex hull of (kept bytes, seconds) from option `from`: the
/// allowed option with less replay time that saves the most time per byte added (ties: the
/// fewest bytes, then the lowest option).
fn hull_step(options: &[Contribution], from: usize) -> Option<usize> {
    let now = &options[from];
    options
        .iter()
        .enumerate()
        .filter(|(_, o)| o.allowed && o.seconds < now.seconds)
        .max_by(|(i, a), (j, b)| {
            per_byte(now, a)
                .total_cmp(&per_byte(now, b))
                .then(b.kept_bytes.cmp(&a.kept_bytes))
                .then(j.cmp(i))
        })
        .map(|(i, _)| i)
}

/// The candidates kept for a frontier of density `steps`: the first and the last, every
/// uniform choice, and between them the fewest points such that consecutive ones are at most
/// `1/steps` of the peak range apart wherever candidates allow.
pub fn thin(front: &[Candidate], steps: u64) -> Vec<Candidate> {
    let (Some(first), Some(last)) = (front.first(), front.last()) else {
        return Vec::new();
    };
    let gap = (last.peak - first.peak) / steps.max(1);
    let mut kept = vec![first.clone()];
    let mut i = 1;
    while i < front.len() {
        let reach = kept[kept.len() - 1].peak.saturating_add(gap);
        let mut j = i;
        if front[i].peak <= reach {
            // The furthest point within reach, stopping at a uniform one.
            while j + 1 < front.len() && front[j + 1].peak <= reach && !front[j].uniform {
                j += 1;
            }
        }
        kept.push(front[j].clone());
        i = j + 1;
    }
    kept
}

/// The gaps of a thinned frontier wider than `1/steps` of its peak range: pairs of
/// consecutive points.
pub fn wide_gaps(front: &[Candidate], steps: u64) -> Vec<(Candidate, Candidate)> {
    let (Some(first), Some(last)) = (front.first(), front.last()) else {
        return Vec::new();
    };
    let gap = (last.peak - first.peak) / steps.max(1);
    front
        .windows(2)
        .filter(|w| w[1].peak - w[0].peak > gap)
        .map(|w| (w[0].clone(), w[1].clone()))
        .collect()
}

/// One layer's figures for the knapsack: the bytes its option keeps, its replay seconds.
fn quanta(f: &Contribution, base: &Contribution, quantum: u64) -> usize {
    let extra = f.kept_bytes.saturating_sub(base.kept_bytes);
    usize::try_from(extra.div_ceil(quantum)).unwrap_or(usize::MAX)
}

/// The most extra bytes any choice can keep, by the linear model.
pub fn max_headroom(model: &Model) -> u64 {
    model
        .options
        .iter()
        .map(|table| {
            table
                .iter()
                .filter(|f| f.allowed)
                .map(|f| f.kept_bytes.saturating_sub(table[0].kept_bytes))
                .max()
                .unwrap_or(0)
        })
        .fold(0u64, u64::saturating_add)
}

/// The solved multiple-choice knapsack over the linear peak model for every headroom up to
/// `max`, quantised in steps of `max / BUCKETS` (fewer steps past [`KNAPSACK_CELLS`]): one
/// dynamic program answers a whole sweep.
pub struct Knapsack<'a> {
    options: &'a [Vec<Contribution>],
    quantum: u64,
    /// Per layer and capacity in quanta, the option of the best choice using at most that
    /// many quanta.
    picks: Vec<Vec<u8>>,
}

impl<'a> Knapsack<'a> {
    pub fn solve(options: &'a [Vec<Contribution>], max: u64) -> Self {
        let buckets = (KNAPSACK_CELLS / (options.len() as u64).max(1)).clamp(1, BUCKETS);
        let quantum = max.div_ceil(buckets).max(1);
        let capacity = (max / quantum) as usize;
        // best[c] = least replay seconds using at most c quanta.
        let mut best = vec![0.0f64; capacity + 1];
        let mut picks: Vec<Vec<u8>> = Vec::with_capacity(options.len());
        for table in options {
            let costs: Vec<usize> = table
                .iter()
                .map(|f| quanta(f, &table[0], quantum))
                .collect();
            let mut next = vec![f64::INFINITY; capacity + 1];
            let mut pick = vec![0u8; capacity + 1];
            for c in 0..=capacity {
                for (o, (f, &k)) in table.iter().zip(&costs).enumerate() {
                    if f.allowed && k <= c && best[c - k] + f.seconds < next[c] {
                        next[c] = best[c - k] + f.seconds;
                        pick[c] = o as u8;
                    }
                }
            }
            best = next;
            picks.push(pick);
        }
        Knapsack {
            options,
            quantum,
            picks,
        }
    }

    /// The best choice with at most `headroom` extra bytes (at most the `max` solved for).
    pub fn choice(&self, headroom: u64) -> Vec<u8> {
        let capacity = self.picks.first().map_or(0, |p| p.len() - 1);
        let mut c = ((headroom / self.quantum) as usize).min(capacity);
        let mut choice = vec![0; self.options.len()];
        for (l, table) in self.options.iter().enumerate().rev() {
            let o = self.picks[l][c];
            choice[l] = o;
            c = c.saturating_sub(quanta(&table[usize::from(o)], &table[0], self.quantum));
        }
        choice
    }
}
