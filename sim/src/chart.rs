//! Pictures of runs (`handoff sim --seeds A..B --plot FILE.svg`, `handoff bench --plot
//! FILE.svg`) and a progress line for long runs: plain SVG text and one rewritten stderr
//! line, no dependencies.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::time::{Duration, Instant};

/// One line of a chart: a name and its points (x, y).
#[derive(Clone, Debug)]
pub struct Series {
    /// The legend's text.
    pub name: String,
    /// Points, drawn in order.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (references).
    pub dashed: bool,
}

/// One panel: axes, their labels and the series drawn on them.
#[derive(Clone, Debug)]
pub struct Panel {
    /// Above the panel.
    pub title: String,
    /// Under the x axis.
    pub x_label: String,
    /// Beside the y axis.
    pub y_label: String,
    /// The x axis is logarithmic (base 2: block sizes).
    pub log_x: bool,
    /// The lines.
    pub series: Vec<Series>,
}

const WIDTH: f64 = 820.0;
const PANEL_HEIGHT: f64 = 340.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 220.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#17becf", "#bcbd22",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A number as a tick label: short, no trailing zeros.
fn tick_label(v: f64, log_x: bool) -> String {
    if log_x {
        let bytes = v.exp2();
        return if bytes >= (1u64 << 20) as f64 {
            format!("{} MiB", bytes / (1u64 << 20) as f64)
        } else {
            format!("{} KiB", bytes / 1024.0)
        };
    }
    if v.abs() >= 1000.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Evenly spaced "nice" ticks covering `lo..=hi`.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= 6.0)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).floor() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 && out.len() < 20 {
        if t >= lo - step * 1e-9 {
            out.push(t);
        }
        t += step;
    }
    out
}

/// The panels one above the other, as an SVG document.
pub fn svg(title: &str, panels: &[Panel]) -> String {
    let height = TOP + panels.len() as f64 * (PANEL_HEIGHT + BOTTOM + TOP);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" font-size="16" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    for (i, panel) in panels.iter().enumerate() {
        let top = TOP + i as f64 * (PANEL_HEIGHT + BOTTOM + TOP) + TOP;
        draw_panel(&mut out, panel, top);
    }
    out.push_str("</svg>\n");
    out
}

fn draw_panel(out: &mut String, p: &Panel, top: f64) {
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let (y0, y1) = (top + PANEL_HEIGHT, top);
    let fx = |x: f64| if p.log_x { x.max(1.0).log2() } else { x };
    let all: Vec<(f64, f64)> = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|&(x, y)| (fx(x), y)))
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" font-size="14" text-anchor="middle">{}</text>"#,
        (x0 + x1) / 2.0,
        top - 10.0,
        escape(&p.title)
    );
    if all.is_empty() {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">no data</text>"#,
            (x0 + x1) / 2.0,
            (y0 + y1) / 2.0
        );
        return;
    }
    let (mut xmin, mut xmax) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &(x, _)| (a.min(x), b.max(x)));
    if xmax - xmin < 1e-9 {
        xmin -= 1.0;
        xmax += 1.0;
    }
    let ymax = all.iter().fold(0f64, |m, &(_, y)| m.max(y)) * 1.08;
    let ymax = if ymax <= 0.0 { 1.0 } else { ymax };
    let sx = |x: f64| x0 + (x - xmin) / (xmax - xmin) * (x1 - x0);
    let sy = |y: f64| y0 - y / ymax * (y0 - y1);
    // Grid, ticks and labels.
    for t in ticks(0.0, ymax) {
        let y = sy(t);
        let _ = writeln!(
            out,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 6.0,
            y + 4.0,
            tick_label(t, false)
        );
    }
    let xticks: Vec<f64> = if p.log_x {
        (xmin.ceil() as i64..=xmax.floor() as i64)
            .map(|v| v as f64)
            .collect()
    } else {
        ticks(xmin, xmax)
    };
    for t in xticks {
        let x = sx(t);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{}" stroke="#999"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
            y0 + 5.0,
            y0 + 18.0,
            tick_label(t, p.log_x)
        );
    }
    let _ = writeln!(
        out,
        r##"<rect x="{x0}" y="{y1}" width="{}" height="{}" fill="none" stroke="#333"/>"##,
        x1 - x0,
        y0 - y1
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (x0 + x1) / 2.0,
        y0 + 38.0,
        escape(&p.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text x="20" y="{:.1}" text-anchor="middle" transform="rotate(-90 20 {:.1})">{}</text>"#,
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0,
        escape(&p.y_label)
    );
    // Lines, points and the legend.
    for (i, s) in p.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| (fx(x), y))
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let dash = if s.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
            pts.join(" ")
        );
        for p in &pts {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(out, r#"<circle cx="{x}" cy="{y}" r="2.5" fill="{color}"/>"#);
        }
        let ly = y1 + 14.0 + i as f64 * 18.0;
        let _ = writeln!(
            out,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
            x1 + 12.0,
            x1 + 36.0,
            x1 + 42.0,
            ly + 4.0,
            escape(&s.name)
        );
    }
}

/// One stderr line that says how far a long run is (done/total, rate, time left), when
/// stderr is a terminal; nothing otherwise. Redrawn at most ten times a second.
pub struct Progress {
    label: String,
    total: u64,
    unit: &'static str,
    started: Instant,
    drawn: Option<Instant>,
    on: bool,
}

impl Progress {
    /// A progress line for `total` steps of `unit` (e.g. `seeds`).
    pub fn new(label: impl Into<String>, total: u64, unit: &'static str) -> Self {
        Self {
            label: label.into(),
            total,
            unit,
            started: Instant::now(),
            drawn: None,
            on: std::io::stderr().is_terminal(),
        }
    }

    /// `done` steps are done.
    pub fn set(&mut self, done: u64) {
        if !self.on
            || self
                .drawn
                .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.drawn = Some(Instant::now());
        let secs = self.started.elapsed().as_secs_f64();
        let rate = done as f64 / secs.max(1e-9);
        let left = self.total.saturating_sub(done) as f64 / rate.max(1e-9);
        let width = 30;
        let filled = (done as usize * width) / (self.total.max(1) as usize);
        let bar = format!(
            "{}{}",
            "#".repeat(filled.min(width)),
            ".".repeat(width - filled.min(width))
        );
        let eta = if done == 0 {
            "?".to_string()
        } else {
            format!("{left:.0}s")
        };
        let line = format!(
            "\r{} [{bar}] {done}/{} {}  {rate:.1}/s  ETA {eta}  ",
            self.label, self.total, self.unit
        );
        let _ = std::io::stderr().write_all(line.as_bytes());
    }

    /// Clears the line.
    pub fn finish(&mut self) {
        if self.on && self.drawn.is_some() {
            let _ = std::io::stderr().write_all(format!("\r{}\r", " ".repeat(100)).as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_is_one_svg_with_every_series_and_its_legend() {
        let panel = Panel {
            title: "throughput".into(),
            x_label: "block".into(),
            y_label: "GB/s".into(),
            log_x: true,
            series: vec![
                Series {
                    name: "ucx write".into(),
                    points: vec![(16384.0, 1.0), (65536.0, 3.5), (4194304.0, 9.0)],
                    dashed: false,
                },
                Series {
                    name: "memcpy <ref>".into(),
                    points: vec![(16384.0, 10.0), (4194304.0, 12.0)],
                    dashed: true,
                },
            ],
        };
        let svg = svg("bench", &[panel]);
        assert!(svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("memcpy &lt;ref&gt;"), "labels are escaped");
        assert!(svg.contains("16 KiB") && svg.contains("4 MiB"), "{svg}");
        assert!(svg.contains("stroke-dasharray"));
    }

    #[test]
    fn ticks_cover_the_range_with_round_steps() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(0.0, 0.37);
        assert!(
            t.len() >= 3 && t[0] == 0.0 && *t.last().unwrap() <= 0.37 + 1e-9,
            "{t:?}"
        );
    }
}
