//! PNG charts with plotters. Text needs a TrueType font: DejaVu Sans, which the set-up script
//! installs (`fonts-dejavu-core`); `WIDE_FONT` points at another file.
use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

const FONT_CANDIDATES: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

fn ensure_font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let path = std::env::var("WIDE_FONT").ok().into_iter().chain(FONT_CANDIDATES.iter().map(|s| s.to_string())).find(|p| Path::new(p).exists());
        let Some(path) = path else {
            return Err("no TrueType font found for plots: install fonts-dejavu-core (scripts/setup.sh does) or set WIDE_FONT".into());
        };
        let bytes: &'static [u8] = Box::leak(std::fs::read(&path).map_err(|e| format!("{path}: {e}"))?.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| format!("{path} is not a usable font"))?;
        Ok(())
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// One named line.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Writes a line chart of `series` to `path` (PNG, 1000 x 600).
pub fn line_chart(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Result<()> {
    ensure_font()?;
    let pts: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
    if pts.is_empty() {
        bail!("nothing to plot for {title}");
    }
    let (x0, x1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let tmp = path.with_extension("tmp.png");
    {
        let root = BitMapBackend::new(&tmp, (1000, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1.max(x0 + 1e-9), (y0 - pad)..(y1 + pad))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        chart.configure_mesh().x_desc(x_label).y_desc(y_label).label_style(("sans-serif", 14)).draw().map_err(|e| anyhow::anyhow!("{e}"))?;
        for (i, s) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).label_font(("sans-serif", 16)).draw().map_err(|e| anyhow::anyhow!("{e}"))?;
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// The training and validation loss curves of a run's `metrics.jsonl`, against tokens.
pub fn loss_curve(metrics: &Path, out: &Path, title: &str) -> Result<()> {
    let text = std::fs::read_to_string(metrics).with_context(|| format!("cannot read {}", metrics.display()))?;
    let (mut train, mut val) = (vec![], vec![]);
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{} has a corrupt line", metrics.display()))?;
        let t = v["tokens"].as_f64().unwrap_or(0.0) / 1e6;
        if let Some(l) = v["loss"].as_f64() {
            train.push((t, l));
        }
        if let Some(l) = v["val_loss"].as_f64() {
            val.push((t, l));
        }
    }
    line_chart(
        out,
        title,
        "training tokens (millions)",
        "cross-entropy (nats/token)",
        &[Series { name: "train".into(), points: train }, Series { name: "validation".into(), points: val }],
    )
}

/// A bar chart: one bar per label (PNG, 1000 x 600).
pub fn bar_chart(path: &Path, title: &str, y_label: &str, bars: &[(String, f64)]) -> Result<()> {
    ensure_font()?;
    if bars.is_empty() {
        bail!("nothing to plot for {title}");
    }
    let lo = bars.iter().map(|b| b.1).fold(0.0f64, f64::min);
    let hi = bars.iter().map(|b| b.1).fold(0.0f64, f64::max);
    let pad = ((hi - lo) * 0.1).max(1e-3);
    let tmp = path.with_extension("tmp.png");
    {
        let root = BitMapBackend::new(&tmp, (1000, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let n = bars.len();
        let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d((0..n - 1).into_segmented(), (lo - pad)..(hi + pad))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(y_label)
            .x_label_formatter(&|x| match x {
                SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
                let color = Palette99::pick(i).to_rgba().filled();
                let mut r = Rectangle::new([(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), *v)], color);
                r.set_margin(0, 0, 25, 25);
                r
            }))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
                Text::new(format!("{v:.3}"), (SegmentValue::CenterOf(i), *v), ("sans-serif", 16).into_font())
            }))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// A heatmap of `values[row][col]` (None = missing cell) with row and column labels.
pub fn heatmap(path: &Path, title: &str, x_label: &str, y_label: &str, cols: &[String], rows: &[String], values: &[Vec<Option<f64>>]) -> Result<()> {
    ensure_font()?;
    let vals: Vec<f64> = values.iter().flatten().flatten().copied().filter(|v| v.is_finite()).collect();
    if vals.is_empty() {
        bail!("nothing to plot for {title}");
    }
    let (lo, hi) = vals.iter().fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
    let tmp = path.with_extension("tmp.png");
    {
        let root = BitMapBackend::new(&tmp, (900, 650)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d((0..cols.len() - 1).into_segmented(), (0..rows.len() - 1).into_segmented())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .x_label_formatter(&|x| match x {
                SegmentValue::CenterOf(i) => cols.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .y_label_formatter(&|y| match y {
                SegmentValue::CenterOf(i) => rows.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        for (r, row) in values.iter().enumerate() {
            for (c, v) in row.iter().enumerate() {
                let (fill, text) = match v {
                    Some(v) if v.is_finite() => {
                        let t = if hi > lo { (v - lo) / (hi - lo) } else { 0.5 };
                        // Low (good) values green, high values red.
                        (RGBColor((60.0 + 180.0 * t) as u8, (200.0 - 140.0 * t) as u8, 90), format!("{v:.3}"))
                    }
                    _ => (RGBColor(200, 200, 200), "failed".to_string()),
                };
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(SegmentValue::Exact(c), SegmentValue::Exact(r)), (SegmentValue::Exact(c + 1), SegmentValue::Exact(r + 1))],
                        fill.filled(),
                    )))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                chart
                    .draw_series(std::iter::once(Text::new(text, (SegmentValue::CenterOf(c), SegmentValue::CenterOf(r)), ("sans-serif", 18).into_font())))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
        }
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}
