//! The marker walk of one session: which intervals are open at each op, and what each kept
//! interval encloses.
//!
//! Intervals are `[begin, end)` between two point markers, walked in execution order: an end
//! without a begin is ignored, a begin while open is ignored, a begin without an end closes at
//! the end of the layer, and ends are handled before begins so that `[a, b)` followed by
//! `[b, c)` hands over cleanly. An end that repeats the end which closed its interval (a
//! region with several outputs marks each of them) is the same close, not a fault. Markers
//! inside a compiled region never fire.
//!
//! The walk costs O(1) per op however many intervals are open: identical intervals of several
//! units are one interval, what an interval encloses is read from running counters (the
//! counts at its close minus those at its open), and the innermost open interval is the last
//! one opened. Work per marker is proportional to the units that marker names.

use std::collections::{BTreeMap, BTreeSet};

use ir::{plan::Reason, EntityId, Graph, IdVec, Node, NodeId, Unit, UnitId};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::{
    recompute, Crossing, Enclosed, Findings, MarkerFault, NodePolicy, Site, Unbalance, UnitKey,
};

/// A distinct `[begin, end)` marker pair of a model and the units that declare it.
struct Interval<'g> {
    begin: &'g str,
    end: &'g str,
    units: Vec<UnitId>,
}

/// A model's intervals, indexed by the markers that open and close them.
pub(super) struct MarkerIndex<'g> {
    intervals: Vec<Interval<'g>>,
    begins: FxHashMap<&'g str, SmallVec<[usize; 2]>>,
    ends: FxHashMap<&'g str, SmallVec<[usize; 2]>>,
}

impl<'g> MarkerIndex<'g> {
    pub(super) fn of(units: &'g IdVec<UnitId, Unit>) -> Self {
        let mut index = MarkerIndex {
            intervals: Vec::new(),
            begins: FxHashMap::default(),
            ends: FxHashMap::default(),
        };
        let mut by_pair: FxHashMap<(&str, &str), usize> = FxHashMap::default();
        for (unit, declared) in units.iter() {
            for i in &declared.intervals {
                let pair = (i.begin.as_str(), i.end.as_str());
                let k = *by_pair.entry(pair).or_insert_with(|| {
                    index.intervals.push(Interval {
                        begin: pair.0,
                        end: pair.1,
                        units: Vec::new(),
                    });
                    let k = index.intervals.len() - 1;
                    index.begins.entry(pair.0).or_default().push(k);
                    index.ends.entry(pair.1).or_default().push(k);
                    k
                });
                let units = &mut index.intervals[k].units;
                if units.last() != Some(&unit) {
                    units.push(unit);
                }
            }
        }
        index
    }
}

/// Running counts of what the walk recorded, to diff at an interval's close.
#[derive(Clone, Copy)]
struct Mark {
    /// Opening order: a later-opened interval is nested in or crosses an earlier one.
    seq: u64,
    kept: usize,
    not_kept: [usize; Reason::ALL.len()],
    /// Length of the compiled-region log.
    log: usize,
}

/// The state of one marker session.
pub(super) struct Session<'a, 'g> {
    index: &'a MarkerIndex<'g>,
    site: Site,
    /// Per unit of the model: kept at this site.
    kept: Vec<bool>,
    /// Per interval with a kept unit: its mark while open (kept intervals only).
    open: Vec<Option<Mark>>,
    /// Open kept intervals by opening order.
    open_order: BTreeMap<u64, usize>,
    /// Per interval: its opening order while open by marker position, compiled markers
    /// included (what encloses an op as written, whatever runs compiled).
    nominal: Vec<Option<u64>>,
    nominal_order: BTreeMap<u64, usize>,
    next_seq: u64,
    now: Mark,
    /// Compiled regions of not-kept ops recorded while some kept interval was open; an entry
    /// is logged when the region changes or an interval opened since the last entry, so each
    /// open interval sees every region it encloses.
    region_log: Vec<&'g str>,
    opened_since_log: bool,
    /// Per interval: closed by its end and not opened since, so a repeated end is no fault.
    closed: Vec<bool>,
    /// Kept units with a marker that fired in eager in this session.
    fired: BTreeSet<UnitId>,
    /// Kept units with markers inside compiled regions, with the regions.
    compiled_markers: BTreeMap<UnitId, BTreeSet<String>>,
    /// When listing: (interval, node) for every op an interval encloses by marker position,
    /// and (interval, None) when it opens.
    listing: Option<Vec<(usize, Option<NodeId>)>>,
    findings: &'a mut Findings,
}

impl<'a, 'g> Session<'a, 'g> {
    pub(super) fn new(
        graph: &'g Graph,
        index: &'a MarkerIndex<'g>,
        kept_units: &[UnitId],
        site: Site,
        findings: &'a mut Findings,
    ) -> Self {
        let mut kept = vec![false; graph.model(site.at.model).units.len()];
        for &u in kept_units {
            kept[u.index()] = true;
        }
        let intervals = index.intervals.len();
        Session {
            index,
            site,
            kept,
            open: vec![None; intervals],
            open_order: BTreeMap::new(),
            nominal: vec![None; intervals],
            nominal_order: BTreeMap::new(),
            next_seq: 0,
            now: Mark {
                seq: 0,
                kept: 0,
                not_kept: [0; Reason::ALL.len()],
                log: 0,
            },
            region_log: Vec::new(),
            opened_since_log: false,
            closed: vec![false; intervals],
            fired: BTreeSet::new(),
            compiled_markers: BTreeMap::new(),
            listing: None,
            findings,
        }
    }

    /// Lists, from now on, the ops each interval encloses by marker position (compiled
    /// markers included): what [`Session::listed`] returns.
    pub(super) fn list_members(&mut self) {
        self.listing = Some(Vec::new());
    }

    /// The ops each interval enclosed, as (begin marker, end marker, node), in walk order; an
    /// opening gives a `None` node, so an interval that enclosed nothing is listed too.
    pub(super) fn listed(&self) -> Vec<(&'g str, &'g str, Option<NodeId>)> {
        self.listing
            .iter()
            .flatten()
            .map(|&(i, node)| {
                let interval = &self.index.intervals[i];
                (interval.begin, interval.end, node)
            })
            .collect()
    }

    /// The units kept at this site that declare `interval`.
    fn kept_units(&self, interval: usize) -> SmallVec<[UnitId; 4]> {
        self.index.intervals[interval]
            .units
            .iter()
            .copied()
            .filter(|u| self.kept[u.index()])
            .collect()
    }

    fn has_kept(&self, interval: usize) -> bool {
        self.index.intervals[interval]
            .units
            .iter()
            .any(|u| self.kept[u.index()])
    }

    fn key(&self, unit: UnitId) -> UnitKey {
        UnitKey {
            model: self.site.at.model,
            unit,
        }
    }

    /// The innermost open kept unit for an op about to run; notes what encloses an op whose
    /// replay can differ from forward.
    pub(super) fn enclosure(&mut self, id: NodeId, node: &Node) -> Option<UnitId> {
        if let Some(listing) = &mut self.listing {
            listing.extend(self.nominal_order.values().map(|&i| (i, Some(id))));
        }
        if node.replay_may_differ() {
            let declared = self
                .nominal_order
                .values()
                .next_back()
                .map(|&i| self.index.intervals[i].units[0]);
            self.findings.nondeterministic.insert(id, declared);
        }
        let &innermost = self.open_order.values().next_back()?;
        self.kept_units(innermost).first().copied()
    }

    /// Counts what the open intervals enclose.
    pub(super) fn record(&mut self, node: &'g Node, policy: NodePolicy) {
        if policy.decision == ir::plan::Decision::Save {
            self.now.kept += 1;
            return;
        }
        self.now.not_kept[policy.reason as usize] += 1;
        if let Some(region) = node.compiled_region.as_deref() {
            let changed = self.region_log.last() != Some(&region);
            if !self.open_order.is_empty() && (changed || self.opened_since_log) {
                self.region_log.push(region);
                self.opened_since_log = false;
            }
        }
    }

    /// Handles a marker node and returns its decision (an identity, recomputed).
    pub(super) fn on_marker(&mut self, node: &Node, marker: &str) -> NodePolicy {
        let ends = self.index.ends.get(marker).cloned().unwrap_or_default();
        let begins = self.index.begins.get(marker).cloned().unwrap_or_default();
        for &i in &ends {
            self.close_nominal(i);
        }
        for &i in &begins {
            self.open_nominal(i);
        }
        if let Some(region) = &node.compiled_region {
            for &i in ends.iter().chain(&begins) {
                for u in self.kept_units(i) {
                    self.compiled_markers
                        .entry(u)
                        .or_default()
                        .insert(region.to_string());
                }
            }
            return recompute(Reason::Compiled, None);
        }
        for &i in &ends {
            if !self.has_kept(i) {
                continue;
            }
            let units = self.kept_units(i);
            self.fired.extend(units);
            match self.open[i].take() {
                Some(mark) => {
                    self.close(i, mark);
                    self.closed[i] = true;
                }
                None if self.closed[i] => {}
                None => self.unbalanced(i, marker, Unbalance::EndWithoutBegin),
            }
        }
        for &i in &begins {
            if !self.has_kept(i) {
                continue;
            }
            let units = self.kept_units(i);
            self.fired.extend(units);
            if self.open[i].is_some() {
                self.unbalanced(i, marker, Unbalance::BeginWhileOpen);
                continue;
            }
            let mark = Mark {
                seq: self.next_seq(),
                log: self.region_log.len(),
                ..self.now
            };
            self.open[i] = Some(mark);
            self.closed[i] = false;
            self.open_order.insert(mark.seq, i);
            self.opened_since_log = true;
        }
        recompute(Reason::Marker, None)
    }

    fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn open_nominal(&mut self, interval: usize) {
        if self.nominal[interval].is_none() {
            let seq = self.next_seq();
            self.nominal[interval] = Some(seq);
            self.nominal_order.insert(seq, interval);
            if let Some(listing) = &mut self.listing {
                listing.push((interval, None));
            }
        }
    }

    fn close_nominal(&mut self, interval: usize) {
        if let Some(seq) = self.nominal[interval].take() {
            self.nominal_order.remove(&seq);
        }
    }

    fn unbalanced(&mut self, interval: usize, marker: &str, kind: Unbalance) {
        let fault = MarkerFault {
            layer: self.site.at.layer,
            micro_batch: self.site.micro_batch,
            marker: marker.to_owned(),
            kind,
        };
        for u in self.kept_units(interval) {
            let key = self.key(u);
            self.findings
                .unbalanced
                .entry(key)
                .or_default()
                .insert(fault.clone());
        }
    }

    /// Closes kept interval `interval`, opened at `mark`: credits what it enclosed to its kept
    /// units, and notes a crossing with the first interval opened inside it that stays open.
    fn close(&mut self, interval: usize, mark: Mark) {
        self.open_order.remove(&mark.seq);
        let enclosed = self.enclosed_since(mark);
        let layer = self.site.at.layer;
        let units = self.kept_units(interval);
        let crossing = self
            .open_order
            .range(mark.seq + 1..)
            .next()
            .and_then(|(_, &other)| self.kept_units(other).first().copied());
        for &u in &units {
            let key = self.key(u);
            self.findings
                .enclosed
                .entry(key)
                .or_default()
                .entry(layer)
                .or_default()
                .absorb(&enclosed);
            if let Some(other) = crossing.filter(|&o| o != u) {
                self.findings.crossings.insert(Crossing {
                    unit: key,
                    other,
                    layer,
                });
            }
        }
    }

    fn enclosed_since(&self, mark: Mark) -> Enclosed {
        let not_kept = Reason::ALL
            .iter()
            .map(|&r| (r, self.now.not_kept[r as usize] - mark.not_kept[r as usize]))
            .filter(|&(_, n)| n > 0)
            .collect();
        Enclosed {
            kept: self.now.kept - mark.kept,
            not_kept,
            compiled_regions: self.region_log[mark.log..]
                .iter()
                .map(|r| r.to_string())
                .collect(),
        }
    }

    /// A begin without an end closes at the layer's end; markers of kept units that fired
    /// only inside compiled regions are recorded.
    pub(super) fn finish(mut self) {
        for i in 0..self.open.len() {
            if let Some(mark) = self.open[i].take() {
                let begin = self.index.intervals[i].begin;
                self.unbalanced(i, begin, Unbalance::BeginWithoutEnd);
                self.close(i, mark);
            }
        }
        let layer = self.site.at.layer;
        for (unit, regions) in std::mem::take(&mut self.compiled_markers) {
            if !self.fired.contains(&unit) {
                let key = self.key(unit);
                self.findings
                    .markers_in_compiled
                    .entry(key)
                    .or_default()
                    .entry(layer)
                    .or_default()
                    .extend(regions);
            }
        }
    }
}
