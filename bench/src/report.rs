//! Results: a table for people, JSON for machines.

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde_json::{Value, json};

/// One scenario's results: named rows of named figures.
pub struct Report {
    /// Scenario name.
    pub name: &'static str,
    /// What was measured.
    pub title: String,
    /// Column names.
    pub columns: Vec<&'static str>,
    /// Rows of figures (same order as `columns`).
    pub rows: Vec<Vec<Value>>,
    /// Notes printed under the table.
    pub notes: Vec<String>,
}

impl Report {
    /// Prints the table.
    pub fn print(&self) {
        let mut table = Table::new();
        table.load_preset(UTF8_FULL_CONDENSED).set_header(self.columns.clone());
        for row in &self.rows {
            table.add_row(row.iter().map(cell).collect::<Vec<_>>());
        }
        println!("\n{}\n{table}", self.title);
        for n in &self.notes {
            println!("  {n}");
        }
    }

    /// The JSON document.
    pub fn json(&self, store: &str) -> Value {
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                Value::Object(
                    self.columns.iter().map(|c| (*c).to_owned()).zip(r.iter().cloned()).collect(),
                )
            })
            .collect();
        json!({ "scenario": self.name, "store": store, "title": self.title, "results": rows, "notes": self.notes })
    }
}

fn cell(v: &Value) -> String {
    match v {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or_default();
            if x.abs() < 10.0 { format!("{x:.2}") } else { format!("{x:.1}") }
        }
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The `q`-quantile (0..=1) of sorted values, in the values' unit.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}
