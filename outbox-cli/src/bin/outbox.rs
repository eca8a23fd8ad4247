//! The `outbox` binary: parses the command line and calls [`outbox_cli::run`].

use clap::Parser;

fn main() -> std::process::ExitCode {
    let opt = outbox_cli::opt::Opt::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    std::process::ExitCode::from(runtime.block_on(outbox_cli::run(opt)))
}
