//! `omnictl`: parse the command line and hand over to the library.

use clap::Parser;

fn main() {
    let cli = omnictl::Cli::parse();
    if let Err(e) = omnictl::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
