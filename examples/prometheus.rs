//! A consumer exporting its metrics to Prometheus: installs the recorder, consumes a
//! stream with duplicates and failures on the demo database, and prints the scrape an
//! HTTP `/metrics` route would serve.
//!
//! ```sh
//! cargo run --example prometheus
//! ```

use inbox_examples::metrics_demo::{consume_stream, install_prometheus};
use inbox_examples::{connect_replica, database_url};
use sea_orm_inbox_migration::{Migrator, MigratorTrait};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let prometheus = install_prometheus()?;
    let db = connect_replica(&database_url()).await?;
    Migrator::up(&db, None).await?;
    let counts = consume_stream(&db, "billing.credit", 20).await?;
    println!("consumed: {counts:?}\n");
    // What a Prometheus server scraping this consumer would read.
    print!("{}", prometheus.render());
    db.close().await?;
    Ok(())
}
