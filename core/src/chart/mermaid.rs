//! Mermaid `stateDiagram-v2` output for a definition.
//!
//! Mermaid ids cannot contain dots, so every state is declared as `state "key" as id` with the
//! id made from its path (`processing.inventory` → `processing_inventory`). Parallel regions
//! are separated by `--`. Edges carry the event, guards in brackets, and timers in
//! parentheses; targetless transitions are drawn as self-loops.

use std::fmt::Write as _;

use super::definition::{Branch, Definition, StateKind};

fn id(path: &str) -> String {
    path.replace('.', "_")
}

impl Definition {
    /// Renders the chart as a Mermaid `stateDiagram-v2`.
    pub fn to_mermaid(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "---\ntitle: {} v{}\n---\nstateDiagram-v2", self.name, self.version);
        self.mermaid_scope(0, 1, &mut out);
        out
    }

    fn mermaid_scope(&self, scope: usize, depth: usize, out: &mut String) {
        let pad = "    ".repeat(depth);
        let node = &self.states[scope];
        if node.kind == StateKind::Parallel {
            // Each region is one concurrent section holding its declaration, its block and
            // its own edges, so nothing leaks into the neighbouring section.
            for (i, &c) in node.children.iter().enumerate() {
                if i > 0 {
                    let _ = writeln!(out, "{pad}--");
                }
                self.mermaid_declare(c, &pad, out);
                self.mermaid_block(c, depth, out);
                self.mermaid_edges(c, &pad, out);
            }
            return;
        }
        for &c in &node.children {
            self.mermaid_declare(c, &pad, out);
        }
        if let Some(initial) = node.initial {
            let _ = writeln!(out, "{pad}[*] --> {}", id(self.path(initial)));
        }
        for &c in &node.children {
            self.mermaid_block(c, depth, out);
        }
        for &c in &node.children {
            self.mermaid_edges(c, &pad, out);
        }
    }

    fn mermaid_declare(&self, s: usize, pad: &str, out: &mut String) {
        let node = &self.states[s];
        let _ = writeln!(out, "{pad}state \"{}\" as {}", node.key, id(&node.path));
    }

    fn mermaid_block(&self, s: usize, depth: usize, out: &mut String) {
        if self.states[s].children.is_empty() {
            return;
        }
        let pad = "    ".repeat(depth);
        let _ = writeln!(out, "{pad}state {} {{", id(self.path(s)));
        self.mermaid_scope(s, depth + 1, out);
        let _ = writeln!(out, "{pad}}}");
    }

    fn mermaid_edges(&self, s: usize, pad: &str, out: &mut String) {
        let node = &self.states[s];
        let from = id(&node.path);
        let mut edge = |branch: &Branch, label: String| {
            // Resolved targets are stored on the flattened transitions; look them up. A
            // transition into several regions draws one arrow per target.
            let mut targets: Vec<String> =
                self.resolved_targets(s, branch).into_iter().map(|t| id(self.path(t))).collect();
            if targets.is_empty() {
                targets.push(from.clone());
            }
            let mut label = label;
            if !branch.guards.is_empty() {
                let _ = write!(label, " [{}]", branch.guards.join(" && "));
            }
            if !branch.actions.is_empty() {
                let _ = write!(label, " / {}", branch.actions.join(", "));
            }
            for target in targets {
                let _ = writeln!(out, "{pad}{from} --> {target} : {label}");
            }
        };
        for t in &node.on {
            let timer = t.timer.as_ref().map(|spec| format!(" ({spec})")).unwrap_or_default();
            for b in &t.branches {
                edge(b, format!("{}{timer}", t.event));
            }
        }
        for b in &node.always {
            edge(b, "@always".to_owned());
        }
        for b in &node.on_done {
            edge(b, "@done".to_owned());
        }
        for b in &node.on_fail {
            edge(b, "@fail".to_owned());
        }
        if let Some(d) = &node.delegation {
            let timeout = d.timeout.map(|t| format!(" (after {t})")).unwrap_or_default();
            for b in &node.on_timeout {
                edge(b, format!("@timeout{timeout}"));
            }
        }
        if node.kind == StateKind::Final {
            let _ = writeln!(out, "{pad}{from} --> [*]");
        }
    }

    fn resolved_targets(&self, s: usize, branch: &Branch) -> Vec<usize> {
        // Branches are flattened in declaration order; match on the exact branch contents.
        let node = &self.states[s];
        let written: Vec<&Branch> = node
            .on
            .iter()
            .flat_map(|t| t.branches.iter())
            .chain(&node.always)
            .chain(&node.on_done)
            .chain(&node.on_fail)
            .chain(&node.on_timeout)
            .collect();
        written
            .iter()
            .position(|b| std::ptr::eq(*b, branch))
            .map(|index| self.drawn_targets(node.transitions[index]))
            .unwrap_or_default()
    }
}
