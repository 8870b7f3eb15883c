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
        p("zero-shot classification", "top-1 accuracy (%)", vec![line("eval/zeroshot/top1", 100.0, "")]),
        p(
            "retrieval R@1",
            "recall (%)",
            vec![line("eval/retrieval/i2t/r1", 100.0, " image->text"), line("eval/retrieval/t2i/r1", 100.0, " text->image")],
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

/// Compact tick labels: plain decimals in a readable range, scientific notation outside it.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-2..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.2}").trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{v:.3}").trim_end_matches('0').trim_end_matches('.').to_string()
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
        top.draw(&Text::new(format!("align runs: {}", names.join("  vs  ")), (12, 8), ("sans-serif", 20).into_font().color(&BLACK)))
            .map_err(err)?;
        let areas = body.split_evenly((rows, cols));
        let short = short_names(&names);
        // One step axis for every panel, so an evaluation point lines up with the training curves.
        let last_step = runs.iter().flat_map(|r| r.curves.values().flatten().map(|p| p.0)).fold(1.0, f64::max);
        for (panel, area) in chosen.iter().zip(areas.iter()) {
            draw_panel(panel, runs, &short, last_step, area).map_err(err)?;
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
    let (y0, y1) = padded(y0, y1);
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
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 13))
        .draw()?;
    let labelled = series.iter().any(|s| !s.0.is_empty());
    // The legend goes in the upper corner the curves leave free: left when they rise.
    let rising = series.iter().filter(|s| s.3.len() > 1).all(|s| s.3.last().unwrap().1 > s.3[0].1);
    let corner = if rising { SeriesLabelPosition::UpperLeft } else { SeriesLabelPosition::UpperRight };
    for (label, colour, second, pts) in series {
        let style = colour.stroke_width(2);
        if pts.len() == 1 {
            chart.draw_series(std::iter::once(Circle::new(pts[0], 4, colour.filled())))?;
        }
        let anno = if second {
            let dashed = DashedLineSeries::new(pts.clone(), 8, 5, style);
            chart.draw_series(dashed)?
        } else {
            chart.draw_series(LineSeries::new(pts.clone(), style))?
        };
        if !label.is_empty() {
            let (dash, gap) = if second { (5, 4) } else { (20, 0) };
            anno.label(label).legend(move |(x, y)| {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_short_and_readable() {
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(1e-3), "1.0e-3");
        assert_eq!(tick(0.25), "0.25");
        assert_eq!(tick(2.5), "2.5");
        assert_eq!(tick(1500.0), "1500");
        assert_eq!(tick(3.0), "3");
    }

    #[test]
    fn legend_names_drop_the_shared_parts_of_the_paths() {
        assert_eq!(short_names(&["/x/lr3/checkpoints/demo", "/x/lr5/checkpoints/demo/"]), vec!["lr3", "lr5"]);
        assert_eq!(short_names(&["runs/a", "runs/b/c"]), vec!["a", "b/c"]);
        assert_eq!(short_names(&["same", "same"]), vec!["same", "same"]);
    }
}
