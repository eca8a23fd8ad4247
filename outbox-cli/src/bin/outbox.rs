//! The `outbox` binary: parses the command line and calls [`outbox_cli::run`].

use clap::Parser;

fn main() -> std::process::ExitCode {
    // `outbox ... | head`: the reader left, so stop as a shell tool killed by SIGPIPE would
    // (exit 141, nothing printed), not with a panic and its backtrace (exit 101). Rust ignores
    // SIGPIPE, so a write to the closed pipe fails, and `println!` panics on that failure.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if outbox_cli::output::is_broken_pipe_panic(message) {
            std::process::exit(outbox_cli::output::EXIT_BROKEN_PIPE);
        }
        default_hook(info);
    }));
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
