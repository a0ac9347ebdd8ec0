//! The `keel` command: operate a Keel store from a shell (see the library for the commands).

use std::io::Write as _;

use clap::Parser as _;
use keel_cli::{Cli, commands, exit};

/// `keel serve` runs for hours and allocates per request; mimalloc spends less CPU on it
/// than the system allocator, for about the same resident set (built without transparent
/// huge pages, see the workspace manifest).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return usage_error(&error),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "error: cannot start the async runtime: {error}");
            return exit::Code::Failure.into();
        }
    };
    let json = cli.json;
    match runtime.block_on(commands::run(cli)) {
        Ok(report) => {
            report.print(json);
            report.code.into()
        }
        Err(error) => {
            let code = exit::classify(&error);
            // A closed pipe or terminal leaves nobody to tell; the exit code still says it.
            if json {
                let _ = writeln!(std::io::stdout(), "{}", keel_cli::output::error_body(&error));
            } else {
                let _ = writeln!(std::io::stderr(), "error: {error:#}");
            }
            code.into()
        }
    }
}

/// What the argument parser refused, or the help and version it was asked for. With
/// `--json` on the command line a refusal is `{"error": …}` on stdout, like any other
/// error; help and version print as text either way. The exit code is the parser's (2
/// for a usage error).
fn usage_error(error: &clap::Error) -> std::process::ExitCode {
    use clap::error::ErrorKind;
    let asked = matches!(error.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion);
    if asked || !keel_cli::json_requested(std::env::args_os()) {
        // clap prints help and version on stdout and refusals on stderr, ignoring a
        // closed stream.
        let _ = error.print();
    } else {
        let body = keel_cli::output::usage_error_body(&error.to_string());
        let _ = writeln!(std::io::stdout(), "{body}");
    }
    u8::try_from(error.exit_code()).map_or(exit::Code::Failure.into(), std::process::ExitCode::from)
}
