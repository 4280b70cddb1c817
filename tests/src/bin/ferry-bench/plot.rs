//! PNG line plots of a figure against the number of Services (plotters, bitmap backend
//! only; the font is DejaVu Sans from Debian's fonts-dejavu-core).

use std::path::Path;

use plotters::prelude::*;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const COLORS: [RGBColor; 5] = [
    RGBColor(90, 90, 90),
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

fn font() -> Result<(), String> {
    use std::sync::OnceLock;
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let bytes = std::fs::read(FONT)
                .map_err(|e| format!("{FONT}: {e} (Debian package fonts-dejavu-core)"))?;
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{FONT}: not a usable font"))
        })
        .clone()
}

/// One line per series over `xs` (log-scale x); `log_y` for figures spanning decades.
pub(crate) fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    xs: &[f64],
    series: &[(String, Vec<f64>)],
    log_y: bool,
) -> Result<(), String> {
    font()?;
    let finite = || {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let (ymin, ymax) = finite().fold((f64::INFINITY, 0.0f64), |(a, b), v| (a.min(v), b.max(v)));
    if xs.is_empty() || !ymax.is_finite() || ymax <= 0.0 {
        return Err("nothing to plot".into());
    }
    let (xmin, xmax) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(0.0, f64::max),
    );
    let xr = (xmin / 1.5)..(xmax * 1.5);
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut b = ChartBuilder::on(&root);
    b.caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .x_label_formatter(&|x| format!("{:.0}", x))
                .label_style(("sans-serif", 14))
                .draw()
                .map_err(|x| e(&x))?;
            for (i, (name, ys)) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                let pts: Vec<(f64, f64)> = xs
                    .iter()
                    .zip(ys)
                    .filter(|(_, y)| y.is_finite() && **y > 0.0)
                    .map(|(x, y)| (*x, *y))
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                    .map_err(|x| e(&x))?
                    .label(name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                chart
                    .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
                    .map_err(|x| e(&x))?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font(("sans-serif", 14))
                .draw()
                .map_err(|x| e(&x))?;
        }};
    }
    if log_y {
        draw!(
            b.build_cartesian_2d(xr.log_scale(), ((ymin / 1.5)..(ymax * 1.5)).log_scale())
                .map_err(|x| e(&x))?
        );
    } else {
        draw!(
            b.build_cartesian_2d(xr.log_scale(), 0.0..(ymax * 1.15))
                .map_err(|x| e(&x))?
        );
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
