//! PNG charts of a run: grouped bars (one group per router, one bar per series) with
//! min–max whiskers. Text needs a TTF: DejaVu Sans from fonts-dejavu-core (setup.sh).

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::report::{spread, Figure};
use crate::suite::Run;

/// The font the charts use.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Errors drawing a chart.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No font to draw text with.
    #[error("reading the chart font {FONT}: {0} (install fonts-dejavu-core, see deploy/setup.sh)")]
    Font(std::io::Error),
    /// The font file is not a usable TTF.
    #[error("the chart font {FONT} is not a valid font")]
    BadFont,
    /// plotters failed.
    #[error("drawing {path}: {detail}")]
    Draw {
        /// The PNG.
        path: PathBuf,
        /// plotters' message.
        detail: String,
    },
}

/// Registers the font once per process (plotters keeps it for the process's lifetime).
pub fn init_font() -> Result<(), Error> {
    let bytes = std::fs::read(FONT).map_err(Error::Font)?;
    // Leaked on purpose: plotters needs 'static font data, loaded once per run.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| Error::BadFont)
}

/// One chart: a title, a y axis label and the figures drawn as series.
pub struct Chart<'a> {
    pub file: &'a str,
    pub title: &'a str,
    pub y: &'a str,
    pub series: Vec<(&'a str, &'a Figure)>,
}

/// Draws `chart` into `dir/chart.file`.
pub fn draw(run: &Run, dir: &Path, chart: &Chart<'_>) -> Result<PathBuf, Error> {
    let path = dir.join(chart.file);
    let err = |e: &dyn std::fmt::Display| Error::Draw {
        path: path.clone(),
        detail: e.to_string(),
    };
    let names: Vec<&str> = run.results.iter().map(|r| r.kind.name()).collect();
    // bars[series][router] = (median, min, max)
    let bars: Vec<Vec<(f64, f64, f64)>> = chart
        .series
        .iter()
        .map(|(_, f)| {
            run.results
                .iter()
                .map(|r| {
                    let s = spread(&f.values(r));
                    (s.median, s.min, s.max)
                })
                .collect()
        })
        .collect();
    let top = bars
        .iter()
        .flatten()
        .map(|b| b.2)
        .filter(|x| x.is_finite())
        .fold(0.0_f64, f64::max)
        .max(1e-9)
        * 1.15;
    let n = names.len();
    let file = path.clone();
    let root = BitMapBackend::new(&file, (1100, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut c = ChartBuilder::on(&root)
        .caption(chart.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5_f64..(n as f64 - 0.5), 0.0_f64..top)
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 {
                names.get(i as usize).copied().unwrap_or("").to_owned()
            } else {
                String::new()
            }
        })
        .y_desc(chart.y)
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(|e| err(&e))?;
    let k = bars.len().max(1) as f64;
    let width = 0.8 / k;
    for (si, (label, _)) in chart.series.iter().enumerate() {
        let color = Palette99::pick(si).to_rgba();
        let x0 = |ri: usize| ri as f64 - 0.4 + si as f64 * width;
        let series = &bars[si];
        c.draw_series(
            series
                .iter()
                .enumerate()
                .filter(|(_, b)| b.0.is_finite())
                .map(|(ri, b)| {
                    Rectangle::new([(x0(ri), 0.0), (x0(ri) + width * 0.9, b.0)], color.filled())
                }),
        )
        .map_err(|e| err(&e))?
        .label(*label)
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        c.draw_series(
            series
                .iter()
                .enumerate()
                .filter(|(_, b)| b.1.is_finite() && b.2 > b.1)
                .map(|(ri, b)| {
                    let x = x0(ri) + width * 0.45;
                    PathElement::new(vec![(x, b.1), (x, b.2)], BLACK.stroke_width(2))
                }),
        )
        .map_err(|e| err(&e))?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(path)
}

/// Every chart of a run.
pub fn draw_all(run: &Run, figs: &[Figure], dir: &Path) -> Vec<Result<PathBuf, Error>> {
    let get = |key: &str| figs.iter().find(|f| f.key == key);
    let pick = |pairs: Vec<(&'static str, String)>| -> Vec<(&'static str, &Figure)> {
        pairs
            .into_iter()
            .filter_map(|(label, key)| Some((label, get(&key)?)))
            .collect()
    };
    let conns = &run.settings.bulk_conns;
    let labels = ["1 conn", "8 conns", "64 conns", "more conns"];
    let label = |i: usize, c: usize| -> &'static str {
        match c {
            1 => labels[0],
            8 => labels[1],
            64 => labels[2],
            _ => labels[3.min(i + 3)],
        }
    };
    let charts = [
        Chart {
            file: "throughput.png",
            title: "Bulk throughput (higher is better)",
            y: "Gbit/s",
            series: pick(
                conns
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (label(i, *c), format!("bulk_{c}_gbit_per_s")))
                    .collect(),
            ),
        },
        Chart {
            file: "latency.png",
            title: "64 B ping-pong round trip, p50 (lower is better)",
            y: "µs",
            series: pick(vec![
                ("unpinned", "ping_unpinned_p50_us".into()),
                ("pinned to one CPU", "ping_pinned_p50_us".into()),
            ]),
        },
        Chart {
            file: "latency_tail.png",
            title: "64 B ping-pong round trip, p99 (lower is better)",
            y: "µs",
            series: pick(vec![
                ("unpinned", "ping_unpinned_p99_us".into()),
                ("pinned to one CPU", "ping_pinned_p99_us".into()),
            ]),
        },
        Chart {
            file: "setup.png",
            title: "Connection setup p50: connect + ClientHello + 1 byte echoed (lower is better)",
            y: "µs",
            series: pick(vec![
                ("unpinned", "setup_unpinned_p50_us".into()),
                ("pinned to one CPU", "setup_pinned_p50_us".into()),
            ]),
        },
        Chart {
            file: "memory.png",
            title: "Router RSS per established idle connection (lower is better)",
            y: "bytes",
            series: pick(vec![("RSS/conn", "rss_bytes_per_idle_conn".into())]),
        },
        Chart {
            file: "cpu.png",
            title: "Machine-wide CPU per GB forwarded (lower is better)",
            y: "CPU s / GB",
            series: pick(
                conns
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (label(i, *c), format!("cpu_s_per_gb_bulk_{c}")))
                    .collect(),
            ),
        },
    ];
    charts.iter().map(|c| draw(run, dir, c)).collect()
}
