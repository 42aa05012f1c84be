//! Command-line flags of the benchmark, parsed by hand: a dozen flags do not need a parser
//! crate in the build.

use crate::BoxError;
use crate::growth::SeedIds;
use crate::purge::{Purger, Setting};
use std::time::Duration;

pub const USAGE: &str = "\
usage: cargo run --release -p inbox-bench -- [flags]

  --postgres URL      also run on PostgreSQL; URL of a database the user may create
                      databases from (the bench creates and drops `inbox_bench`)
  --mysql URL         also run on MySQL/MariaDB (same rule)
  --no-sqlite         skip the default SQLite run (a file in a temporary directory)
  --quick             smoke run: short rounds, small growth and purge sets
  --rounds N          interleaved rounds per measurement (default 10, quick 1)
  --seconds S         seconds per mode per round (default 1, quick 0.25)
  --concurrency LIST  worker counts, comma separated (default 1,8,32)
  --growth-rows N     rows in the inbox for the growth and purge phases
                      (default 5000000, quick 20000; 0 skips both phases)
  --growth-points LIST  the cost curve instead of one growth point: markers in the
                      inbox at each point, ascending, comma separated, k and M allowed
                      (e.g. 0,1M,10M,50M,100M); each point seeds only the rows it adds
                      to the last, measures claim, process and raw, the table's and
                      indexes' sizes, and the purge of one day (a hundredth) of the rows
  --growth-ids KIND   message ids of the seeded markers: random (default; the layout of
                      UUIDv4) or v7 (time-ordered: received_at's milliseconds first, so
                      a day's markers are adjacent in the message-id index too, as
                      UUIDv7 producers lay them); the measured modes' ids are as before
  --curve-purger KIND  how each cost-curve point purges its day: library (default:
                      the library's purge at its default pacing), hand (one hand-written
                      DELETE ... LIMIT --purge-batch after another) or streams:N (N
                      hand-written streams at once, each batch SELECT ... FOR UPDATE
                      SKIP LOCKED then DELETE by key; PostgreSQL and MariaDB)
  --curve-csv PATH    write the cost curve's points as CSV
  --curve-svg PATH    write the cost curve (throughput against markers) as SVG
  --curve-from LIST   measure nothing: write --curve-csv and --curve-svg from the cost
                      curve CSVs listed (comma separated), e.g. one per backend
  --database NAME     the server database to create and drop (default inbox_bench)
  --purge-batch N     rows per purge transaction (default 10000, quick 1000)
  --purge-concurrency LIST  claimers during the purge phase (default 8,32; quick 8)
  --purge-detail      print where each purge's time went (batches, deleting, resting,
                      the cutoff's walk) to stderr
  --phases LIST       phases to run, comma separated, of main, mix, growth, purge
                      (default all; purge seeds the growth rows without measuring growth)
  --modes LIST        main-phase modes to run, comma separated (default all; names as in
                      the tables, e.g. batch,batch_raw)
  --instructions N    first count client-side instructions per message of raw, on_conflict,
                      claim, process, batch_raw and batch (per transaction) under callgrind
                      (needs valgrind), N and 2N messages on SQLite in memory; with
                      --no-sqlite and no server, only that
  --server-counters N  measure no rate: run N messages of each --modes mode over the
                      most --concurrency workers and print per message, on MySQL/MariaDB,
                      the server's status counters (Com_*, Handler_*, Innodb_*); on
                      PostgreSQL (same machine), the CPU of this client and of the
                      workers' backends (/proc), WAL bytes, and the marker rows' widths
  --csv PATH          write every measurement as CSV
  --svg PATH          write the chart (throughput as a fraction of base) as SVG
  --tables PATH       write the tables and targets of every backend as Markdown
  --replot CSV        measure nothing: redraw --svg from a CSV an earlier run wrote
                      (with that run's --growth-rows)
";

/// Everything the flags decide.
#[derive(Clone, Debug)]
pub struct Args {
    pub postgres: Option<String>,
    pub mysql: Option<String>,
    pub sqlite: bool,
    pub rounds: usize,
    pub round_time: Duration,
    pub concurrency: Vec<usize>,
    pub growth_rows: u64,
    /// The cost curve's points (markers), ascending; empty for one growth point.
    pub growth_points: Vec<u64>,
    /// The layout of the seeded markers' message ids.
    pub growth_ids: SeedIds,
    /// How each cost-curve point purges its day.
    pub curve_purger: Purger,
    pub curve_csv: Option<String>,
    pub curve_svg: Option<String>,
    pub curve_from: Vec<String>,
    pub database: String,
    pub purge_batch: u64,
    pub csv: Option<String>,
    pub svg: Option<String>,
    pub replot: Option<String>,
    pub purge_concurrency: Vec<usize>,
    pub instructions: Option<u64>,
    /// `MODE:N`: the child process `--instructions` runs under callgrind.
    pub count_only: Option<String>,
    /// Messages per mode for the server's counters instead of the phases.
    pub server_counters: Option<u64>,
    pub tables: Option<String>,
    /// Print each purge's time split.
    pub purge_detail: bool,
    /// The phases to run, of [`PHASES`].
    pub phases: Vec<String>,
    /// The main-phase modes to run, by name; empty for all.
    pub modes: Vec<String>,
}

/// Every phase, in the order a run takes them.
pub const PHASES: [&str; 4] = ["main", "mix", "growth", "purge"];

impl Args {
    /// Whether `phase` runs.
    pub fn runs(&self, phase: &str) -> bool {
        self.phases.iter().any(|p| p == phase)
    }

    /// Parses `std::env::args()`; `Ok(None)` when `--help` asked for the usage text.
    pub fn from_env() -> Result<Option<Self>, BoxError> {
        Self::parse(std::env::args().skip(1))
    }

    fn parse(mut flags: impl Iterator<Item = String>) -> Result<Option<Self>, BoxError> {
        let mut raw = RawArgs::default();
        while let Some(flag) = flags.next() {
            let mut value = || {
                flags
                    .next()
                    .ok_or_else(|| format!("{flag} needs a value\n\n{USAGE}"))
            };
            match flag.as_str() {
                "--help" | "-h" => return Ok(None),
                "--postgres" => raw.postgres = Some(value()?),
                "--mysql" => raw.mysql = Some(value()?),
                "--no-sqlite" => raw.no_sqlite = true,
                "--quick" => raw.quick = true,
                "--rounds" => raw.rounds = Some(value()?.parse()?),
                "--seconds" => raw.seconds = Some(value()?.parse()?),
                "--concurrency" => raw.concurrency = Some(parse_list(&value()?)?),
                "--growth-rows" => raw.growth_rows = Some(value()?.parse()?),
                "--growth-points" => raw.growth_points = Some(parse_counts(&value()?)?),
                "--growth-ids" => raw.growth_ids = Some(SeedIds::parse(&value()?)?),
                "--curve-purger" => raw.curve_purger = Some(Purger::parse(&value()?)?),
                "--curve-csv" => raw.curve_csv = Some(value()?),
                "--curve-svg" => raw.curve_svg = Some(value()?),
                "--curve-from" => raw.curve_from = Some(parse_names(&value()?)),
                "--database" => raw.database = Some(value()?),
                "--purge-batch" => raw.purge_batch = Some(value()?.parse()?),
                "--csv" => raw.csv = Some(value()?),
                "--svg" => raw.svg = Some(value()?),
                "--replot" => raw.replot = Some(value()?),
                "--purge-concurrency" => raw.purge_concurrency = Some(parse_list(&value()?)?),
                "--instructions" => raw.instructions = Some(value()?.parse()?),
                "--count-only" => raw.count_only = Some(value()?),
                "--server-counters" => raw.server_counters = Some(value()?.parse()?),
                "--tables" => raw.tables = Some(value()?),
                "--phases" => raw.phases = Some(parse_names(&value()?)),
                "--purge-detail" => raw.purge_detail = true,
                "--modes" => raw.modes = Some(parse_names(&value()?)),
                other => return Err(format!("unknown flag {other}\n\n{USAGE}").into()),
            }
        }
        raw.resolve().map(Some)
    }
}

/// Flags as given, before the `--quick` defaults fill the gaps.
#[derive(Default)]
struct RawArgs {
    postgres: Option<String>,
    mysql: Option<String>,
    no_sqlite: bool,
    quick: bool,
    rounds: Option<usize>,
    seconds: Option<f64>,
    concurrency: Option<Vec<usize>>,
    growth_rows: Option<u64>,
    growth_points: Option<Vec<u64>>,
    growth_ids: Option<SeedIds>,
    curve_purger: Option<Purger>,
    curve_csv: Option<String>,
    curve_svg: Option<String>,
    curve_from: Option<Vec<String>>,
    database: Option<String>,
    purge_batch: Option<u64>,
    csv: Option<String>,
    svg: Option<String>,
    replot: Option<String>,
    purge_concurrency: Option<Vec<usize>>,
    instructions: Option<u64>,
    count_only: Option<String>,
    server_counters: Option<u64>,
    tables: Option<String>,
    phases: Option<Vec<String>>,
    modes: Option<Vec<String>>,
    purge_detail: bool,
}

impl RawArgs {
    fn resolve(self) -> Result<Args, BoxError> {
        let quick = self.quick;
        let seconds = self.seconds.unwrap_or(pick(quick, 1.0, 0.25));
        if !(seconds > 0.0 && seconds.is_finite()) {
            return Err("--seconds must be a positive number".into());
        }
        let rounds = self.rounds.unwrap_or(pick(quick, 10, 1));
        let concurrency = self.concurrency.unwrap_or_else(|| vec![1, 8, 32]);
        if rounds == 0 || concurrency.is_empty() {
            return Err("--rounds and --concurrency need at least one value".into());
        }
        let purge_batch = self.purge_batch.unwrap_or(pick(quick, 10_000, 1_000));
        if purge_batch == 0 {
            return Err("--purge-batch must be positive".into());
        }
        let replot = self.replot.is_some() || self.curve_from.is_some();
        let no_backend =
            !replot && self.no_sqlite && self.postgres.is_none() && self.mysql.is_none();
        if no_backend && self.instructions.is_none() {
            return Err("--no-sqlite leaves no backend: give --postgres or --mysql".into());
        }
        if self.instructions == Some(0) {
            return Err("--instructions needs a positive message count".into());
        }
        if self.server_counters == Some(0) {
            return Err("--server-counters needs a positive message count".into());
        }
        let purge_concurrency = self
            .purge_concurrency
            .unwrap_or_else(|| pick(quick, vec![8, 32], vec![8]));
        if purge_concurrency.is_empty() {
            return Err("--purge-concurrency needs at least one value".into());
        }
        if let Some(name) = &self.database
            && !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err("--database takes letters, digits and underscores only".into());
        }
        let phases = self
            .phases
            .unwrap_or_else(|| PHASES.iter().map(|p| (*p).to_owned()).collect());
        if let Some(unknown) = phases.iter().find(|p| !PHASES.contains(&p.as_str())) {
            return Err(format!("unknown phase {unknown}: give some of {PHASES:?}").into());
        }
        Ok(Args {
            postgres: self.postgres,
            mysql: self.mysql,
            sqlite: !self.no_sqlite,
            rounds,
            round_time: Duration::from_secs_f64(seconds),
            concurrency,
            growth_rows: self.growth_rows.unwrap_or(pick(quick, 5_000_000, 20_000)),
            growth_points: self.growth_points.unwrap_or_default(),
            growth_ids: self.growth_ids.unwrap_or_default(),
            curve_purger: self
                .curve_purger
                .unwrap_or(Purger::Library(Setting::Default)),
            curve_csv: self.curve_csv,
            curve_svg: self.curve_svg,
            curve_from: self.curve_from.unwrap_or_default(),
            database: self
                .database
                .unwrap_or_else(|| crate::db::BENCH_DATABASE.to_owned()),
            purge_batch,
            csv: self.csv,
            svg: self.svg,
            replot: self.replot,
            purge_concurrency,
            instructions: self.instructions,
            count_only: self.count_only,
            server_counters: self.server_counters,
            tables: self.tables,
            phases,
            modes: self.modes.unwrap_or_default(),
            purge_detail: self.purge_detail,
        })
    }
}

fn parse_list(list: &str) -> Result<Vec<usize>, BoxError> {
    let values = list
        .split(',')
        .map(|item| item.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()?;
    if values.contains(&0) {
        return Err("--concurrency values must be positive".into());
    }
    Ok(values)
}

/// `0,1M,10M,50k`: counts with an optional k (thousand) or M (million), ascending.
fn parse_counts(list: &str) -> Result<Vec<u64>, BoxError> {
    let counts = list
        .split(',')
        .map(|item| {
            let item = item.trim();
            let (digits, scale) = match item.strip_suffix(['M', 'm']) {
                Some(digits) => (digits, 1_000_000),
                None => match item.strip_suffix(['k', 'K']) {
                    Some(digits) => (digits, 1_000),
                    None => (item, 1),
                },
            };
            digits
                .parse::<u64>()
                .ok()
                .and_then(|n| n.checked_mul(scale))
                .ok_or_else(|| format!("--growth-points: {item} is not a count like 10M"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if counts.windows(2).any(|pair| pair[0] >= pair[1]) {
        return Err("--growth-points must ascend".into());
    }
    Ok(counts)
}

fn parse_names(list: &str) -> Vec<String> {
    list.split(',').map(|name| name.trim().to_owned()).collect()
}

/// The full-run default, or the smoke-run one under `--quick`.
fn pick<T>(quick: bool, full: T, smoke: T) -> T {
    if quick { smoke } else { full }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> Result<Option<Args>, BoxError> {
        Args::parse(flags.iter().map(|flag| flag.to_string()))
    }

    #[test]
    fn defaults_to_a_full_sqlite_run() -> Result<(), BoxError> {
        let args = parse(&[])?.ok_or("usage instead of args")?;
        assert!(args.sqlite && args.postgres.is_none() && args.mysql.is_none());
        assert_eq!((args.rounds, args.concurrency), (10, vec![1, 8, 32]));
        assert_eq!((args.growth_rows, args.purge_batch), (5_000_000, 10_000));
        Ok(())
    }

    #[test]
    fn quick_shrinks_the_run_and_flags_override_it() -> Result<(), BoxError> {
        let args = parse(&["--quick", "--rounds", "2", "--concurrency", "1,4"])?
            .ok_or("usage instead of args")?;
        assert_eq!((args.rounds, args.concurrency), (2, vec![1, 4]));
        assert_eq!(args.growth_rows, 20_000);
        Ok(())
    }

    #[test]
    fn growth_points_take_suffixes() -> Result<(), BoxError> {
        let args = parse(&["--growth-points", "0,50k, 1M,100M"])?.ok_or("usage instead of args")?;
        assert_eq!(args.growth_points, vec![0, 50_000, 1_000_000, 100_000_000]);
        assert_eq!(args.database, "inbox_bench");
        assert_eq!(args.growth_ids, SeedIds::Random);
        let args = parse(&["--growth-ids", "v7", "--curve-purger", "streams:4"])?
            .ok_or("usage instead of args")?;
        assert_eq!(args.growth_ids, SeedIds::TimeOrdered);
        assert_eq!(args.curve_purger, Purger::Streams(4));
        Ok(())
    }

    #[test]
    fn server_counters_take_a_message_count() -> Result<(), BoxError> {
        let args = parse(&[
            "--no-sqlite",
            "--mysql",
            "mysql://x/y",
            "--server-counters",
            "800",
        ])?
        .ok_or("usage instead of args")?;
        assert_eq!(args.server_counters, Some(800));
        assert_eq!(parse(&[])?.ok_or("usage")?.server_counters, None);
        Ok(())
    }

    #[test]
    fn refuses_bad_flags() {
        assert!(parse(&["--bogus"]).is_err());
        assert!(parse(&["--rounds"]).is_err());
        assert!(parse(&["--concurrency", "0"]).is_err());
        assert!(parse(&["--no-sqlite"]).is_err());
        assert!(parse(&["--seconds", "-1"]).is_err());
        assert!(parse(&["--phases", "main,bogus"]).is_err());
        assert!(parse(&["--growth-points", "10M,1M"]).is_err());
        assert!(parse(&["--growth-points", "1G"]).is_err());
        assert!(parse(&["--growth-ids", "v1"]).is_err());
        assert!(parse(&["--curve-purger", "streams:0"]).is_err());
        assert!(parse(&["--curve-purger", "fast"]).is_err());
        assert!(parse(&["--database", "x; DROP"]).is_err());
        assert!(parse(&["--server-counters", "0"]).is_err());
        assert!(matches!(parse(&["--help"]), Ok(None)));
    }
}
