//! Observability: every `Inbox::process` call is one `inbox.process` span carrying
//! message_id, consumer, outcome, attempts and duration_ms, with a settle event inside it,
//! and the in-process counters match a scripted run.
//!
//! One global subscriber captures every span; each backend's test runs under a consumer
//! name of its own and reads only its spans, so the tests run in parallel.

use inbox_tests::{
    Backend, create_accounts, credit, hold_claim_then_roll_back, impatient_replica,
    on_every_backend, with_migrated_db,
};
use sea_orm::{DatabaseConnection, DbErr};
use sea_orm_inbox::prelude::*;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use uuid::Uuid;

/// A span or event as captured: its name and fields, rendered as text.
#[derive(Clone, Debug, Default)]
struct Captured {
    name: String,
    fields: BTreeMap<String, String>,
    /// Events: the fields of the enclosing `inbox.process` span, as they were then.
    span_fields: BTreeMap<String, String>,
    /// Events: their level (the guide's tracing table promises each one).
    level: Option<tracing::Level>,
}

impl Captured {
    fn field(&self, name: &str) -> &str {
        self.fields
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("{} has no field {name}: {:?}", self.name, self.fields))
    }
}

impl Visit for Captured {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.fields
            .insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.fields
            .insert(field.name().to_owned(), value.to_owned());
    }
}

/// The events recorded inside `inbox.process` spans, each with a snapshot of the span.
///
/// Spans are read at their settle event rather than at close: sqlx's SQLite worker keeps
/// the current span of its last command alive until the next one.
#[derive(Default)]
struct Captures {
    events: Vec<Captured>,
}

fn captures() -> &'static Mutex<Captures> {
    static CAPTURES: OnceLock<Mutex<Captures>> = OnceLock::new();
    CAPTURES.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(CaptureLayer);
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
        Mutex::default()
    })
}

struct CaptureLayer;

impl<S> Layer<S> for CaptureLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut captured = Captured {
            name: attrs.metadata().name().to_owned(),
            ..Captured::default()
        };
        attrs.record(&mut captured);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(captured);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(captured) = span.extensions_mut().get_mut::<Captured>()
        {
            values.record(captured);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let Some(span_fields) = span
            .extensions()
            .get::<Captured>()
            .filter(|span| span.name == "inbox.process")
            .map(|span| span.fields.clone())
        else {
            return;
        };
        let mut captured = Captured {
            name: event.metadata().name().to_owned(),
            span_fields,
            level: Some(*event.metadata().level()),
            ..Captured::default()
        };
        event.record(&mut captured);
        lock().events.push(captured);
    }
}

fn lock() -> std::sync::MutexGuard<'static, Captures> {
    captures().lock().unwrap_or_else(|p| p.into_inner())
}

/// For `consumer`: the final state of each `inbox.process` span (snapshot at its settle
/// event) and every event inside those spans, in order.
fn captured_for(consumer: &str) -> (Vec<Captured>, Vec<Captured>) {
    let captures = lock();
    let events: Vec<Captured> = captures
        .events
        .iter()
        .filter(|e| e.span_fields.get("consumer").map(String::as_str) == Some(consumer))
        .cloned()
        .collect();
    let spans = events
        .iter()
        .filter(|e| e.fields.contains_key("outcome"))
        .map(|e| Captured {
            name: "inbox.process".into(),
            fields: e.span_fields.clone(),
            span_fields: BTreeMap::new(),
            level: None,
        })
        .collect();
    (spans, events)
}

async fn credit_or_fail(
    inbox: &Inbox,
    conn: &DatabaseConnection,
    id: Uuid,
    fail: bool,
) -> Result<Outcome<()>, ProcessError<DbErr>> {
    inbox
        .process(conn, id, move |txn| {
            Box::pin(async move {
                credit(txn, 1).await?;
                if fail {
                    return Err(DbErr::Custom("injected handler failure".into()));
                }
                Ok(())
            })
        })
        .await
}

/// Processed, duplicate, handler error, redelivery, and a claim that meets another
/// replica's lock and is retried: spans, events and counters all tell the same story.
async fn spans_and_counters_describe_a_scripted_run(backend: Backend) {
    let _ = captures();
    with_migrated_db(backend, async |db| {
        let consumer = format!("observability.{backend:?}");
        let conn = impatient_replica(db).await;
        create_accounts(&conn).await;
        let inbox = Inbox::new(consumer.clone())
            .expect("valid name")
            .with_retry(
                RetryPolicy::default()
                    .max_attempts(30)
                    .backoff(Duration::from_millis(50), Duration::from_millis(200))
                    .expect("a short backoff"),
            );
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());

        let script = [(a, false), (a, false), (b, true), (b, false)];
        for (id, fail) in script {
            let _ = credit_or_fail(&inbox, &conn, id, fail).await;
        }
        let hold = if backend == Backend::MySql { 2500 } else { 600 };
        let holder = hold_claim_then_roll_back(db, c, &consumer, Duration::from_millis(hold)).await;
        let retried = credit_or_fail(&inbox, &conn, c, false).await;
        holder.await.expect("holder");
        assert!(matches!(retried, Ok(Outcome::Processed(()))), "{retried:?}");

        let (spans, events) = captured_for(&consumer);
        let summary: Vec<(String, String)> = spans
            .iter()
            .map(|s| {
                (
                    s.field("message_id").to_owned(),
                    s.field("outcome").to_owned(),
                )
            })
            .collect();
        let expected: Vec<(String, String)> = [
            (a, "processed"),
            (a, "duplicate"),
            (b, "handler_error"),
            (b, "processed"),
            (c, "processed"),
        ]
        .iter()
        .map(|(id, outcome)| (id.to_string(), (*outcome).to_owned()))
        .collect();
        assert_eq!(summary, expected, "one span per call, in order");

        let mut retries_in_spans = 0;
        for span in &spans {
            assert_eq!(span.field("consumer"), consumer);
            let attempts: u64 = span
                .field("attempts")
                .parse()
                .expect("attempts is a number");
            let duration: f64 = span
                .field("duration_ms")
                .parse()
                .expect("duration is a number");
            assert!(attempts >= 1 && duration >= 0.0, "{span:?}");
            retries_in_spans += attempts - 1;
        }
        let c_attempts: u64 = spans[4].field("attempts").parse().expect("number");
        assert!(
            c_attempts >= 2,
            "the claim met the holder's lock: {:?}",
            spans[4]
        );
        assert!(
            spans[4]
                .field("duration_ms")
                .parse::<f64>()
                .expect("number")
                >= 50.0,
            "the retried call lasted at least one backoff: {:?}",
            spans[4]
        );

        use tracing::Level;
        let settled: Vec<(&str, Option<Level>)> = events
            .iter()
            .filter_map(|e| Some((e.fields.get("message")?.as_str(), e.level)))
            .filter(|(m, _)| !m.starts_with("transient"))
            .collect();
        assert_eq!(
            settled,
            [
                ("delivery settled: ack", Some(Level::DEBUG)),
                ("delivery settled: ack", Some(Level::DEBUG)),
                ("handler failed: nack", Some(Level::INFO)),
                ("delivery settled: ack", Some(Level::DEBUG)),
                ("delivery settled: ack", Some(Level::DEBUG)),
            ],
            "{events:#?}"
        );
        let handler_failed = events
            .iter()
            .find(|e| e.fields.get("message").map(String::as_str) == Some("handler failed: nack"))
            .expect("the handler's failure is an event");
        assert!(
            handler_failed
                .fields
                .get("error")
                .is_some_and(|error| error.contains("injected handler failure")),
            "the event carries the handler's error text: {handler_failed:?}"
        );
        let retry_events: Vec<&Captured> = events
            .iter()
            .filter(|e| {
                e.fields
                    .get("message")
                    .is_some_and(|m| m.starts_with("transient"))
            })
            .collect();
        assert_eq!(
            retry_events.len() as u64,
            c_attempts - 1,
            "{retry_events:#?}"
        );
        for event in &retry_events {
            assert_eq!(event.level, Some(Level::INFO), "{event:?}");
            assert_eq!(event.span_fields.get("message_id"), Some(&c.to_string()));
            assert!(event.fields.contains_key("error"), "{event:?}");
        }

        let counts = inbox.metrics().snapshot();
        assert_eq!(
            (
                counts.processed,
                counts.duplicates,
                counts.handler_errors,
                counts.failures
            ),
            (3, 1, 1, 0),
            "{counts:?}"
        );
        assert_eq!(
            counts.transient_retries, retries_in_spans,
            "{counts:?} vs spans {spans:#?}"
        );
        println!(
            "observability on {backend:?}: {counts:?}, retried claim took {c_attempts} attempts"
        );
    })
    .await;
}

on_every_backend!(spans_and_counters_describe_a_scripted_run);
