//! The figure: a grid of panels (loss, temperature, learning rate, throughput, gradient norm,
//! data wait, and the evaluation metrics when a run has them), each run one colour throughout.

use anyhow::{anyhow, Result};
use image::RgbImage;
use plotters::prelude::*;

use super::canvas::Canvas;
use super::runs::Run;

/// One line of a panel: a tag of the runs' curves, scaled for display, with a suffix telling
/// lines of the same run apart.
struct Line {
    tag: &'static str,
    scale: f64,
    suffix: &'static str,
}

struct Panel {
    title: &'static str,
    unit: &'static str,
    lines: Vec<Line>,
}

fn line(tag: &'static str, scale: f64, suffix: &'static str) -> Line {
    Line { tag, scale, suffix }
}

fn panels() -> Vec<Panel> {
    let p = |title, unit, lines| Panel { title, unit, lines };
    vec![
        p(
            "loss (image->text + text->image)",
            "nats",
            vec![line("train/loss", 1.0, " training"), line("eval/validation/loss", 1.0, " held-out")],
        ),
        p("temperature (logits are cos/temperature)", "temperature", vec![line("train/temperature", 1.0, "")]),
        p("sigmoid loss: logit scale t (logits are t·cos + b)", "t", vec![line("train/logit_scale", 1.0, "")]),
        p("sigmoid loss: logit bias b", "b", vec![line("train/logit_bias", 1.0, "")]),
        p("learning rate", "lr", vec![line("train/lr", 1.0, "")]),
        p("throughput", "samples/s", vec![line("train/samples_per_s", 1.0, "")]),
        p("gradient norm (before clipping)", "L2 norm", vec![line("train/grad_norm", 1.0, "")]),
        p("waiting for data", "% of wall time", vec![line("train/data_wait_share", 100.0, "")]),
        p("zero-shot classification", "top-1 accuracy (%)", vec![line("eval/zeroshot/acc1", 100.0, "")]),
        p(
            "retrieval R@1",
            "recall (%)",
            vec![
                line("eval/retrieval/text_retrieval_recall@1", 100.0, " image->text"),
                line("eval/retrieval/image_retrieval_recall@1", 100.0, " text->image"),
            ],
        ),
    ]
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
];

/// Tick labels with as many decimals as the distance between ticks (`spacing`) needs, so that
/// neighbouring ticks never read alike (0.0671, 0.0672 rather than 0.067 twice); scientific
/// notation outside [0.01, 100000).
fn tick(v: f64, spacing: f64) -> String {
    let a = v.abs();
    let spacing = spacing.abs().max(f64::MIN_POSITIVE);
    if a < spacing * 1e-6 {
        return "0".into();
    }
    if !(1e-2..1e5).contains(&a) {
        let digits = ((a / spacing).log10().ceil().max(1.0) as usize).min(6);
        let s = format!("{v:.prec$e}", prec = digits.saturating_sub(1).max(1));
        return trim_mantissa(&s);
    }
    let decimals = (-spacing.log10()).ceil().clamp(0.0, 8.0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A step count as people write one: `500`, `2500`, `50k`, `150k`, `1.2M`.
fn step_tick(v: f64, spacing: f64) -> String {
    let a = v.abs();
    let (unit, suffix) = if a >= 1e6 {
        (1e6, "M")
    } else if a >= 1e4 {
        (1e3, "k")
    } else {
        return tick(v, spacing.max(1.0));
    };
    let decimals = (-(spacing / unit).log10()).ceil().clamp(0.0, 3.0) as usize;
    let s = format!("{:.decimals$}", v / unit);
    let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
    format!("{s}{suffix}")
}

/// `1.50e-3` → `1.5e-3`.
fn trim_mantissa(s: &str) -> String {
    match s.split_once('e') {
        Some((m, e)) if m.contains('.') => {
            let m = m.trim_end_matches('0');
            let m = if m.ends_with('.') { format!("{m}0") } else { m.to_string() };
            format!("{m}e{e}")
        }
        _ => s.to_string(),
    }
}

/// A label cut to `max` characters in its middle, keeping its start and its end (run names
/// differ at one or the other); ASCII dots, which the figure's bitmap font has.
fn ellipsized(label: &str, max: usize) -> String {
    let n = label.chars().count();
    if n <= max || max < 4 {
        return label.to_string();
    }
    let head = (max - 3) / 2;
    let tail = max - 3 - head;
    let start: String = label.chars().take(head).collect();
    let end: String = label.chars().skip(n - tail).collect();
    format!("{start}...{end}")
}

/// TensorBoard's smoothing: an exponential moving average with weight `w` on the past, debiased
/// so the first points are not pulled towards zero.
pub fn smoothed(points: &[(f64, f64)], w: f64) -> Vec<(f64, f64)> {
    let mut avg = 0.0;
    let mut out = Vec::with_capacity(points.len());
    for (i, &(x, y)) in points.iter().enumerate() {
        avg = w * avg + (1.0 - w) * y;
        out.push((x, avg / (1.0 - w.powi(i as i32 + 1))));
    }
    out
}

/// How the figure is drawn.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub width: u32,
    /// Smoothing of the training curves, 0 (none) to below 1 (TensorBoard's slider); the raw
    /// curve stays beside the smoothed one, faint.
    pub smooth: f64,
}

impl Default for Options {
    fn default() -> Self {
        Options { width: 1500, smooth: 0.0 }
    }
}

fn padded(lo: f64, hi: f64) -> (f64, f64) {
    if (hi - lo).abs() < 1e-12 * hi.abs().max(1.0) {
        let d = if hi == 0.0 { 1.0 } else { hi.abs() * 0.1 };
        (lo - d, hi + d)
    } else {
        let d = (hi - lo) * 0.05;
        (lo - d, hi + d)
    }
}

/// Short legend names: the runs' paths without the components they all share at either end
/// (`/x/lr3/checkpoints/demo` and `/x/lr5/checkpoints/demo` become `lr3` and `lr5`).
pub fn short_names(paths: &[&str]) -> Vec<String> {
    let parts: Vec<Vec<&str>> = paths.iter().map(|p| p.split('/').filter(|c| !c.is_empty() && *c != ".").collect()).collect();
    let shortest = parts.iter().map(Vec::len).min().unwrap_or(0);
    let lead = (0..shortest).take_while(|&i| parts.iter().all(|p| p[i] == parts[0][i])).count();
    let from_end = |p: &Vec<&'_ str>, i: usize| p[p.len() - 1 - i].to_string();
    let trail = (0..shortest - lead).take_while(|&i| parts.iter().all(|p| from_end(p, i) == from_end(&parts[0], i))).count();
    parts
        .iter()
        .zip(paths)
        .map(|(p, full)| {
            let kept = p[lead..p.len() - trail].join("/");
            if kept.is_empty() {
                full.to_string()
            } else {
                kept
            }
        })
        .collect()
}

/// Renders the runs' curves; panels no run has data for are left out.
pub fn render(runs: &[Run], width: u32) -> Result<RgbImage> {
    render_with(runs, &Options { width, ..Options::default() })
}

/// Renders the runs' curves as `o` says.
pub fn render_with(runs: &[Run], o: &Options) -> Result<RgbImage> {
    let width = o.width;
    let chosen: Vec<Panel> = panels()
        .into_iter()
        .filter(|p| p.lines.iter().any(|l| runs.iter().any(|r| r.curves.get(l.tag).is_some_and(|c| !c.is_empty()))))
        .collect();
    if chosen.is_empty() {
        return Err(anyhow!("none of the runs has a curve to plot"));
    }
    let cols = if chosen.len() > 4 { 3 } else { 2 };
    let rows = chosen.len().div_ceil(cols);
    let panel_h = (width as f64 / cols as f64 * 0.72) as u32;
    let header = 34;
    let mut img = RgbImage::from_pixel(width, header + rows as u32 * panel_h, image::Rgb([255, 255, 255]));
    {
        let root = Canvas::new(&mut img).into_drawing_area();
        let err = |e: DrawingAreaErrorKind<std::convert::Infallible>| anyhow!("drawing the plot: {e:?}");
        let (top, body) = root.split_vertically(header);
        let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        // About 11 pixels a character at this size: the title never runs off the figure.
        let room = (width as usize).saturating_sub(24) / 11;
        let per_run = (room / names.len().max(1)).saturating_sub(4).max(12);
        let title: Vec<String> = names.iter().map(|n| ellipsized(n, per_run)).collect();
        top.draw(&Text::new(
            ellipsized(&format!("align runs: {}", title.join("  vs  ")), room),
            (12, 8),
            ("sans-serif", 20).into_font().color(&BLACK),
        ))
        .map_err(err)?;
        let areas = body.split_evenly((rows, cols));
        let short = short_names(&names);
        // One step axis for every panel, so an evaluation point lines up with the training curves.
        let last_step = runs.iter().flat_map(|r| r.curves.values().flatten().map(|p| p.0)).fold(1.0, f64::max);
        for (panel, area) in chosen.iter().zip(areas.iter()) {
            draw_panel(panel, runs, &short, last_step, o.smooth, area).map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(img)
}

fn draw_panel(
    panel: &Panel,
    runs: &[Run],
    names: &[String],
    last_step: f64,
    smooth: f64,
    area: &DrawingArea<Canvas<'_>, plotters::coord::Shift>,
) -> std::result::Result<(), DrawingAreaErrorKind<std::convert::Infallible>> {
    // (legend label, colour, dashed, points)
    type Series = (String, RGBColor, bool, Vec<(f64, f64)>);
    let mut series: Vec<Series> = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        for (j, l) in panel.lines.iter().enumerate() {
            if let Some(c) = run.curves.get(l.tag).filter(|c| !c.is_empty()) {
                let label = if runs.len() > 1 { format!("{}{}", names[i], l.suffix) } else { l.suffix.trim().to_string() };
                let label = ellipsized(&label, 28);
                series.push((label, colour, j > 0, c.iter().map(|&(s, v)| (s, v * l.scale)).collect()));
            }
        }
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
    for (_, _, _, pts) in &series {
        for &(x, y) in pts.iter().filter(|(x, y)| x.is_finite() && y.is_finite()) {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
    }
    if !x0.is_finite() {
        return Ok(());
    }
    let (x0, x1) = (x0.min(0.0), last_step.max(x1));
    let (mut y0, mut y1) = padded(y0, y1);
    if panel.unit.contains('%') {
        // Percentages stay within what they can be.
        (y0, y1) = (y0.max(0.0), y1.min(100.0).max(y0 + 1e-9));
    }
    let (x_spacing, y_spacing) = ((x1 - x0) / 6.0, (y1 - y0) / 6.0);
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, ("sans-serif", 15).into_font())
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    chart
        .configure_mesh()
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(210, 210, 210))
        .x_desc("step")
        .y_desc(panel.unit)
        .x_labels(6)
        .y_labels(6)
        .x_label_formatter(&|v| step_tick(*v, x_spacing))
        .y_label_formatter(&|v| tick(*v, y_spacing))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 13))
        .draw()?;
    let labelled = series.iter().any(|s| !s.0.is_empty());
    let corner = emptiest_corner(&series.iter().map(|s| s.3.as_slice()).collect::<Vec<_>>(), (x0, x1), (y0, y1));
    for (label, colour, second, pts) in series {
        let style = colour.stroke_width(2);
        // Long training curves can be smoothed; the raw curve stays, faint.
        let pts = if smooth > 0.0 && pts.len() > 30 && panel.lines.iter().all(|l| l.tag.starts_with("train/")) {
            chart.draw_series(LineSeries::new(pts.clone(), colour.mix(0.25).stroke_width(1)))?;
            smoothed(&pts, smooth)
        } else {
            pts
        };
        // Evaluations come a few points at a time: each one gets a marker.
        if pts.len() <= 30 {
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
        }
        let anno = if second {
            let dashed = DashedLineSeries::new(pts.clone(), 8, 5, style);
            chart.draw_series(dashed)?
        } else {
            chart.draw_series(LineSeries::new(pts.clone(), style))?
        };
        if !label.is_empty() {
            let (dash, gap) = if second { (5, 4) } else { (20, 0) };
            // A trailing space keeps the text off the legend's border: plotters measures this
            // bitmap font a little narrower than it draws.
            anno.label(format!("{label} ")).legend(move |(x, y)| {
                plotters::element::DashedPathElement::new(vec![(x, y), (x + 20, y)], dash, gap, colour.stroke_width(2))
            });
        }
    }
    if labelled {
        chart
            .configure_series_labels()
            .position(corner)
            .label_font(("sans-serif", 13))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .draw()?;
    }
    Ok(())
}

/// The legend's corner: the one whose region (the outer half of the width, 45% of the height)
/// holds fewest of the curves' points.
fn emptiest_corner(curves: &[&[(f64, f64)]], (x0, x1): (f64, f64), (y0, y1): (f64, f64)) -> SeriesLabelPosition {
    let (w, h) = (x1 - x0, y1 - y0);
    // The lines between points count too: evaluation curves have few points and long segments.
    let mut points: Vec<(f64, f64)> = Vec::new();
    for c in curves {
        points.extend(c.iter().copied());
        for pair in c.windows(2) {
            let ((ax, ay), (bx, by)) = (pair[0], pair[1]);
            points.extend((1..16).map(|k| {
                let f = k as f64 / 16.0;
                (ax + f * (bx - ax), ay + f * (by - ay))
            }));
        }
    }
    let count = |left: bool, top: bool| {
        points
            .iter()
            .filter(|(x, y)| {
                let in_x = if left { *x <= x0 + 0.5 * w } else { *x >= x1 - 0.5 * w };
                let in_y = if top { *y >= y1 - 0.45 * h } else { *y <= y0 + 0.45 * h };
                in_x && in_y
            })
            .count()
    };
    [
        (SeriesLabelPosition::UpperRight, count(false, true)),
        (SeriesLabelPosition::UpperLeft, count(true, true)),
        (SeriesLabelPosition::LowerRight, count(false, false)),
        (SeriesLabelPosition::LowerLeft, count(true, false)),
    ]
    .into_iter()
    .min_by_key(|c| c.1)
    .map(|c| c.0)
    .unwrap_or(SeriesLabelPosition::UpperRight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_short_and_neighbours_never_read_alike() {
        assert_eq!(tick(0.0, 0.1), "0");
        assert_eq!(tick(1e-3, 2e-4), "1.0e-3");
        assert_eq!(tick(1.5e-3, 2e-4), "1.5e-3");
        assert_eq!(tick(0.25, 0.05), "0.25");
        assert_eq!(tick(2.5, 0.5), "2.5");
        assert_eq!(tick(1500.0, 250.0), "1500");
        assert_eq!(tick(3.0, 1.0), "3");
        let steps: Vec<String> = [0.0, 500.0, 50_000.0, 150_000.0, 1_200_000.0].iter().map(|&v| step_tick(v, 50_000.0)).collect();
        assert_eq!(steps, ["0", "500", "50k", "150k", "1.2M"]);
        // A temperature that moves in the fourth decimal.
        let ticks: Vec<String> = [0.06710, 0.06715, 0.06720, 0.06725].iter().map(|&v| tick(v, 0.00005)).collect();
        assert_eq!(ticks, ["0.0671", "0.06715", "0.0672", "0.06725"]);
    }

    #[test]
    fn long_labels_keep_their_end_and_smoothing_is_debiased() {
        assert_eq!(ellipsized("short", 10), "short");
        assert_eq!(ellipsized("runs/sweep/lr-3e-4-wd-0.1-long-name", 12), "runs...-name");
        let flat = smoothed(&[(0.0, 5.0), (1.0, 5.0), (2.0, 5.0)], 0.9);
        assert!(flat.iter().all(|p| (p.1 - 5.0).abs() < 1e-12), "{flat:?}");
        let step = smoothed(&[(0.0, 0.0), (1.0, 10.0)], 0.5);
        assert!((step[1].1 - 10.0 * 0.5 / 0.75).abs() < 1e-12);
    }

    #[test]
    fn the_legend_goes_where_the_curves_are_not() {
        // A falling curve fills the upper left and the lower right.
        let falling: Vec<(f64, f64)> = (0..100).map(|i| (i as f64, 100.0 - i as f64)).collect();
        let c = emptiest_corner(&[&falling], (0.0, 100.0), (0.0, 100.0));
        assert!(matches!(c, SeriesLabelPosition::UpperRight | SeriesLabelPosition::LowerLeft), "{c:?}");
        let rising: Vec<(f64, f64)> = (0..100).map(|i| (i as f64, i as f64)).collect();
        let c = emptiest_corner(&[&rising], (0.0, 100.0), (0.0, 100.0));
        assert!(matches!(c, SeriesLabelPosition::UpperLeft | SeriesLabelPosition::LowerRight), "{c:?}");
    }

    #[test]
    fn legend_names_drop_the_shared_parts_of_the_paths() {
        assert_eq!(short_names(&["/x/lr3/checkpoints/demo", "/x/lr5/checkpoints/demo/"]), vec!["lr3", "lr5"]);
        assert_eq!(short_names(&["runs/a", "runs/b/c"]), vec!["a", "b/c"]);
        assert_eq!(short_names(&["same", "same"]), vec!["same", "same"]);
    }
}
