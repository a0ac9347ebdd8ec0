//! A help desk on Keel: tickets go open → in_progress → closed. Starting work needs an
//! assignee (a guard), starting stamps the ticket (an entry action), and a ticket in
//! progress for 2 s without a CLOSE is abandoned (an `after` timer). SQLite in
//! `./ticket.db` by default; PostgreSQL when `KEEL_DATABASE_URL` is set.
use keel::{ChartMachine, Definition, Keel, NewSignal, Timer, json};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Unset or empty: the SQLite file (an empty URL would name no store at all).
    let url = std::env::var("KEEL_DATABASE_URL")
        .ok()
        .filter(|url| !url.is_empty())
        .unwrap_or_else(|| "sqlite://ticket.db".into());
    let keel = Keel::connect(&url).await?;
    let chart = Definition::builder("ticket", 1)
        .guard("assigned", |ctx, _| ctx.get("assignee").is_some_and(keel::Value::is_string))
        .initial("open")
        .state("open", |s| {
            s.on("START", |t| t.guard("assigned").target("in_progress")).on_to("CLOSE", "closed")
        })
        .state("in_progress", |s| {
            s.entry("stamp")
                .on_to("CLOSE", "closed")
                .on("IDLE", |t| t.target("abandoned").after(Timer::seconds(2)))
        })
        .final_state("closed")
        .final_state("abandoned")
        .build()?;
    let ticket = ChartMachine::new(chart).action("stamp", |ctx, _| async move {
        let who = ctx.get("assignee").unwrap_or_default();
        ctx.set("log", json!([format!("started by {}", who.as_str().unwrap_or("?"))]));
        Ok(())
    });
    let worker = keel.worker().register(ticket.clone())?.spawn()?;
    println!("store: {}", keel.describe());

    let mut ids = Vec::new();
    for n in 0..10 {
        let assignee = if n % 4 == 3 { json!(null) } else { json!(format!("agent-{}", n % 3)) };
        let id =
            keel.start(ticket.new_instance(json!({ "n": n, "assignee": assignee }))).await?.id();
        let events = ["START", "CLOSE"].into_iter().take(1 + n % 2);
        keel.send_many(events.map(|e| NewSignal::new(id, e)).collect()).await?;
        ids.push(id);
    }
    for (n, id) in ids.into_iter().enumerate() {
        let ended = keel.wait_timeout(id, std::time::Duration::from_secs(60)).await?;
        let ended = ended.ok_or(format!("ticket {id} has not ended after 60 s"))?;
        let log = ended.result.as_ref().map_or(json!(null), |r| r["log"].clone());
        println!("ticket {id}: {} in {:<9} log {log}", ended.status, ended.state.to_string());
        let want = if n % 2 == 1 { "closed" } else { "abandoned" }; // a START alone times out
        if ended.state.to_string() != want {
            return Err(format!("ticket {id} ended in {} instead of {want}", ended.state).into());
        }
    }
    worker.shutdown().await;
    Ok(())
}
