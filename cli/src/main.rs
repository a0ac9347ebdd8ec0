//! The `keel` command: operate a Keel store from a shell (see the library for the commands).

use clap::Parser as _;
use keel_cli::{Cli, commands, exit};

/// `keel serve` runs for hours and allocates per request; mimalloc spends less CPU on it
/// than the system allocator, for about the same resident set (built without transparent
/// huge pages, see the workspace manifest).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
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
            if json {
                println!("{}", keel_cli::output::error_body(&error));
            } else {
                eprintln!("error: {error:#}");
            }
            code.into()
        }
    }
}
