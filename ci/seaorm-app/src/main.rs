//! The application's binary, as in SeaORM's examples: everything lives in `api`.

fn main() -> std::process::ExitCode {
    api::main()
}
