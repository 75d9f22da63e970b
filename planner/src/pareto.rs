//! `planner pareto`: the whole memory / recompute trade-off: the frontier the budget search
//! finds ([`crate::budget`]), every combination when there are few (exact), else a dense
//! sample of it; `--budget` answers from the same frontier.

use std::fmt::Write as _;

use ir::{
    plan::{LayerKeep, LayerOffload, LayerRef},
    Graph, UnitId,
};

use crate::{
    budget::{BudgetError, Search},
    units::{format_bytes, format_seconds},
};

#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub peak_bytes: u64,
    pub replay_time_s: f64,
    /// The offload copies' time compute does not hide (0 without offload).
    pub exposed_transfer_time_s: f64,
    /// Activation bytes saved for backward (on the device or in host memory).
    pub saved_bytes: u64,
    /// Per-layer units kept; empty keeps nothing.
    pub layer_keep: Vec<LayerKeep>,
    /// Per-layer kept units, and layer inputs, offloaded to host memory; empty offloads
    /// nothing.
    pub layer_offload: Vec<LayerOffload>,
}

impl Point {
    /// What the frontier trades against the peak: replay plus exposed transfer time.
    pub fn time_s(&self) -> f64 {
        self.replay_time_s + self.exposed_transfer_time_s
    }
}

/// The frontier by increasing peak, with consecutive points at most `1/steps` of the peak
/// range apart where candidates allow (every point when the search is exhaustive).
pub fn frontier(search: &Search<'_>, steps: u64) -> Result<Vec<Point>, BudgetError> {
    Ok(search
        .frontier(steps)?
        .iter()
        .map(|p| Point {
            peak_bytes: p.figures.peak_bytes,
            replay_time_s: p.figures.replay_time_s,
            exposed_transfer_time_s: 0.0,
            saved_bytes: p.figures.saved_bytes,
            layer_keep: search.layer_keep(p),
            layer_offload: Vec::new(),
        })
        .collect())
}

/// `pareto --with-offload`: the frontier of [`frontier`]'s points and each one's variants
/// with part or all of its kept units and layer inputs offloaded
/// ([`Search::offloaded_points`]), time being
/// replay plus exposed transfer time: the points no other beats on both, by increasing peak.
pub fn frontier_with_offload(search: &Search<'_>, steps: u64) -> Result<Vec<Point>, BudgetError> {
    let mut points = frontier(search, steps)?;
    points.extend(
        search
            .offloaded_points(steps)?
            .into_iter()
            .map(|plan| Point {
                peak_bytes: plan.memory.peak_bytes.unwrap_or(0),
                replay_time_s: plan.cost.replay_time_s,
                exposed_transfer_time_s: plan.cost.exposed_transfer_time_s,
                saved_bytes: plan.memory.saved_bytes,
                layer_keep: plan.config.layer_keep,
                layer_offload: plan.config.layer_offload,
            }),
    );
    let beaten = |p: &Point| {
        points.iter().any(|q| {
            q.peak_bytes <= p.peak_bytes
                && q.time_s() <= p.time_s()
                && (q.peak_bytes < p.peak_bytes || q.time_s() < p.time_s())
        })
    };
    let mut front: Vec<Point> = points.iter().filter(|p| !beaten(p)).cloned().collect();
    front.sort_by(|a, b| {
        a.peak_bytes
            .cmp(&b.peak_bytes)
            .then(a.time_s().total_cmp(&b.time_s()))
    });
    front.dedup_by(|a, b| a.peak_bytes == b.peak_bytes && a.time_s() == b.time_s());
    Ok(front)
}

/// `main layers 0-3: SAVE_ATTN; main layer 4: ...`, or `nothing`.
pub fn describe(layer_keep: &[LayerKeep], graph: &Graph) -> String {
    if layer_keep.iter().all(|l| l.units.is_empty()) {
        return "nothing (whole-layer recompute)".to_owned();
    }
    describe_layers(
        layer_keep
            .iter()
            .map(|l| (l.at, unit_names(graph, l.at, &l.units))),
        graph,
    )
}

/// `SAVE_ATTN+SAVE_MLP`, or `none`.
fn unit_names(graph: &Graph, at: LayerRef, units: &[UnitId]) -> String {
    let model = graph.model(at.model);
    match units {
        [] => "none".to_owned(),
        units => units
            .iter()
            .map(|&u| model.units[u].name.as_str())
            .collect::<Vec<_>>()
            .join("+"),
    }
}

/// Per-layer labels as runs of consecutive layers with the same label:
/// `main layers 0-3: SAVE_ATTN; main layer 4: ...`.
fn describe_layers(labels: impl Iterator<Item = (LayerRef, String)>, graph: &Graph) -> String {
    let mut runs: Vec<(&str, u32, u32, String)> = Vec::new();
    for (at, keep) in labels {
        let model = graph.model(at.model);
        let layer = at.layer;
        match runs.last_mut() {
            Some((name, _, last, k)) if *name == model.name && *last + 1 == layer && *k == keep => {
                *last = layer;
            }
            _ => runs.push((&model.name, layer, layer, keep)),
        }
    }
    runs.into_iter()
        .map(|(model, first, last, keep)| match first == last {
            true => format!("{model} layer {first}: {keep}"),
            false => format!("{model} layers {first}-{last}: {keep}"),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The frontier as a table.
pub fn table(graph: &Graph, hw: &str, points: &[Point]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pareto frontier for {} ({hw}): {} configurations",
        graph.name(),
        points.len()
    );
    // The exposed transfer time and the offloaded units, when a point offloads.
    let offloads = points.iter().any(|p| !p.layer_offload.is_empty());
    let _ = match offloads {
        true => writeln!(
            out,
            "{:>24}  {:>12}  {:>12}  keeps; offloads",
            "peak", "replay time", "exposed"
        ),
        false => writeln!(out, "{:>24}  {:>12}  keeps", "peak", "replay time"),
    };
    for p in points {
        let _ = write!(
            out,
            "{:>24}  {:>12}",
            format_bytes(p.peak_bytes),
            format_seconds(p.replay_time_s)
        );
        if offloads {
            let _ = write!(out, "  {:>12}", format_seconds(p.exposed_transfer_time_s));
        }
        let _ = write!(out, "  {}", describe(&p.layer_keep, graph));
        if offloads {
            let _ = write!(out, "; {}", describe_offload(&p.layer_offload, graph));
        }
        out.push('\n');
    }
    out
}

/// `offloads main layer 0: SAVE_ATTN+layer input`, or `offloads nothing`.
pub fn describe_offload(layer_offload: &[LayerOffload], graph: &Graph) -> String {
    if layer_offload
        .iter()
        .all(|l| l.units.is_empty() && !l.layer_input)
    {
        return "offloads nothing".to_owned();
    }
    let label = |l: &LayerOffload| match (l.units.is_empty(), l.layer_input) {
        (true, true) => "layer input".to_owned(),
        (false, true) => format!("{}+layer input", unit_names(graph, l.at, &l.units)),
        _ => unit_names(graph, l.at, &l.units),
    };
    format!(
        "offloads {}",
        describe_layers(layer_offload.iter().map(|l| (l.at, label(l))), graph)
    )
}

/// The frontier as JSON: per point the figures and the per-layer choices, in the form
/// `plan --choices` reads back.
pub fn json(graph: &Graph, points: &[Point]) -> String {
    let points: Vec<serde_json::Value> = points
        .iter()
        .map(|p| {
            serde_json::json!({
                "peak_bytes": p.peak_bytes,
                "replay_time_s": p.replay_time_s,
                "exposed_transfer_time_s": p.exposed_transfer_time_s,
                "saved_bytes": p.saved_bytes,
                "layer_keep": ir::plan::json::layer_keep_value(&p.layer_keep, graph),
                "layer_offload": ir::plan::json::layer_offload_value(&p.layer_offload, graph),
            })
        })
        .collect();
    let mut text = serde_json::to_string_pretty(&serde_json::json!({
        "graph": graph.name(),
        "fingerprint": graph.fingerprint(),
        "points": points,
    }))
    .expect("the frontier serialises to JSON");
    text.push('\n');
    text
}

/// The frontier as an SVG plot: peak (x) against replay time (y), points joined by steps,
/// with ticks on both axes and every label inside the image.
pub fn svg(graph: &Graph, points: &[Point]) -> String {
    let plot = Plot::of(points);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="{FONT}">"#
    );
    let _ = writeln!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="14">{}</text>"#,
        W / 2.0,
        escape(&clip(
            &format!("{}: peak memory vs replay time", graph.name()),
            80
        ))
    );
    svg_axes(&mut out, &plot);
    svg_points(&mut out, &plot, points, graph);
    let _ = writeln!(out, "</svg>");
    out
}

const W: f64 = 720.0;
const H: f64 = 440.0;
const FONT: f64 = 11.0;
/// Margins: room for the y tick labels on the left and the x tick labels below.
const LEFT: f64 = 90.0;
const RIGHT: f64 = 40.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 64.0;
const TICKS: usize = 5;

/// The data ranges and their mapping to the drawing area.
struct Plot {
    x: (f64, f64),
    y: (f64, f64),
}

impl Plot {
    fn of(points: &[Point]) -> Plot {
        Plot {
            x: bounds(points.iter().map(|p| p.peak_bytes as f64)),
            y: bounds(points.iter().map(Point::time_s)),
        }
    }

    fn px(&self, v: f64) -> f64 {
        LEFT + (v - self.x.0) / (self.x.1 - self.x.0) * (W - LEFT - RIGHT)
    }

    fn py(&self, v: f64) -> f64 {
        H - BOTTOM - (v - self.y.0) / (self.y.1 - self.y.0) * (H - TOP - BOTTOM)
    }
}

/// Both axes with [`TICKS`] evenly spaced ticks and labels, and the axis titles.
fn svg_axes(out: &mut String, plot: &Plot) {
    let (x0, x1, y0) = (LEFT, W - RIGHT, H - BOTTOM);
    let _ = writeln!(
        out,
        r#"<path d="M{x0} {y0} H{x1} M{x0} {y0} V{TOP}" stroke="black" fill="none"/>"#
    );
    for k in 0..TICKS {
        let t = k as f64 / (TICKS - 1) as f64;
        let xv = plot.x.0 + t * (plot.x.1 - plot.x.0);
        let x = plot.px(xv);
        // The end labels hang inward so they stay inside the image.
        let anchor = match k {
            0 => "start",
            k if k == TICKS - 1 => "end",
            _ => "middle",
        };
        let _ = writeln!(
            out,
            r#"<path d="M{x:.1} {y0} v5" stroke="black"/><text x="{x:.1}" y="{:.1}" text-anchor="{anchor}">{}</text>"#,
            y0 + 18.0,
            escape(&short_bytes(xv.max(0.0) as u64))
        );
        let yv = plot.y.0 + t * (plot.y.1 - plot.y.0);
        let y = plot.py(yv);
        let _ = writeln!(
            out,
            r#"<path d="M{x0} {y:.1} h-5" stroke="black"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            x0 - 8.0,
            y + 4.0,
            escape(&format_seconds(yv))
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">predicted peak (activations)</text>"#,
        (x0 + x1) / 2.0,
        H - 18.0
    );
    let _ = writeln!(
        out,
        r#"<text x="16" y="{:.1}" transform="rotate(-90 16 {:.1})" text-anchor="middle">predicted replay (+ exposed transfer) time</text>"#,
        (TOP + y0) / 2.0,
        (TOP + y0) / 2.0
    );
}

/// The frontier as a staircase and its points, each with a tooltip of its choices.
fn svg_points(out: &mut String, plot: &Plot, points: &[Point], graph: &Graph) {
    let path: Vec<String> = points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (x, y) = (plot.px(p.peak_bytes as f64), plot.py(p.time_s()));
            match i {
                0 => format!("M{x:.1} {y:.1}"),
                _ => format!("H{x:.1} V{y:.1}"),
            }
        })
        .collect();
    let _ = writeln!(
        out,
        r##"<path d="{}" stroke="#1f77b4" fill="none"/>"##,
        path.join(" ")
    );
    for p in points {
        let _ = writeln!(
            out,
            r##"<circle cx="{:.1}" cy="{:.1}" r="4" fill="#1f77b4"><title>{}, {}: {}{}</title></circle>"##,
            plot.px(p.peak_bytes as f64),
            plot.py(p.time_s()),
            escape(&format_bytes(p.peak_bytes)),
            escape(&format_seconds(p.time_s())),
            escape(&describe(&p.layer_keep, graph)),
            match p.layer_offload.is_empty() {
                true => String::new(),
                false => escape(&format!("; {}", describe_offload(&p.layer_offload, graph))),
            }
        );
    }
}

/// `47.3 MiB`: the scaled part of [`format_bytes`], for tick labels.
fn short_bytes(bytes: u64) -> String {
    let long = format_bytes(bytes);
    long.split(" (").next().unwrap_or(&long).to_owned()
}

/// At most `max` characters, an ellipsis marking the cut.
fn clip(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// Min and max, widened so a single point still has a range.
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = lo.abs().max(1.0) * 0.05;
        return (lo - pad, hi + pad);
    }
    (lo, hi)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
