//! The store conformance suite: one generic async function per contract, run by every
//! `Store` backend — the in-memory reference included — under the same test names.
//!
//! Contracts know nothing about any backend. They use fixed timestamps (never the system
//! clock) and build their own rows in their own namespaces. Each expects a fresh, empty
//! store (some look at every namespace: a claim with no filter, a purge of all dead
//! letters), so a database backend hands each test its own schema. The expected rows come
//! from `keel_core::outcome`, the pure reference.
//!
//! A backend crate runs the suite from an integration test:
//!
//! ```text
//! // store-postgres/tests/conformance.rs
//! keel_testkit::store_conformance_tests!(
//!     keel_store_postgres::testing::fresh_schema(),   // async, returns Option<PgStore>
//!     "KEEL_TEST_DATABASE_URL"                         // what to set when it is None
//! );
//! ```
//!
//! Each generated `#[tokio::test]` evaluates the constructor expression itself, so every
//! test may get a fresh schema. `None` means "backend not configured": the test prints
//! `SKIPPED: …` to stderr and passes, unless `KEEL_REQUIRE_BACKENDS=1`, when it panics and
//! names the variable to set. The calling crate needs `tokio` (macros, rt) as a
//! dev-dependency.

pub mod queue;
pub mod support;

mod charts;
mod children;
mod claim_policies;
mod claims;
mod dead_letters;
mod history;
mod inbox;
mod inputs;
mod joins;
mod leases;
mod migration;
mod operations;
mod outcomes;
mod overview;
mod registry;
mod retention;
mod schedules;
mod signals;
mod timer_suspended;
mod timers;
mod uniqueness;

pub use charts::*;
pub use children::*;
pub use claim_policies::*;
pub use claims::*;
pub use dead_letters::*;
pub use history::*;
pub use inbox::*;
pub use inputs::*;
pub use joins::*;
pub use leases::*;
pub use migration::*;
pub use operations::*;
pub use outcomes::*;
pub use overview::*;
pub use registry::*;
pub use retention::*;
pub use schedules::*;
pub use signals::*;
pub use timer_suspended::*;
pub use timers::*;
pub use uniqueness::*;

/// Prints a skip notice straight to the process's stderr. The test harness captures
/// `eprintln!` of passing tests, which would hide the notice; a direct write is not
/// captured, so a skipped backend is visible in a plain `cargo test` run.
pub fn skip_notice(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{message}");
}

/// The environment variable that turns a missing backend from a skip into a failure.
pub const REQUIRE_BACKENDS_VAR: &str = "KEEL_REQUIRE_BACKENDS";

/// The one list of store contracts. It feeds both [`STORE_CONTRACTS`] and
/// [`store_conformance_tests!`](crate::store_conformance_tests), so they cannot drift.
#[doc(hidden)]
#[macro_export]
macro_rules! __store_contract_list {
    ($callback:ident ; $($args:tt)*) => {
        $crate::$callback! { [$($args)*]
            outcome_next_matches_reference,
            outcome_retry_matches_reference,
            outcome_await_parks_matches_reference,
            outcome_schedule_children_matches_reference,
            outcome_done_matches_reference,
            outcome_stop_matches_reference,
            outcome_suspend_matches_reference,
            stale_token_rejected_nothing_changed,
            batch_commit_one_stale_others_succeed,
            invalid_outcome_rejected_without_partial_write,
            batch_commit_refused_items_do_not_drop_their_neighbours,
            await_signal_before_park_commits_runnable,
            await_park_then_signal_wakes,
            await_any_signal_wakes_on_any_name,
            consume_only_seen_signals,
            signal_dedup_across_calls_and_within_batch,
            signal_ids_in_a_batch_name_the_signals_stored,
            signal_to_missing_target_reported,
            signal_to_terminal_target_reported_not_stored,
            terminal_commit_drains_inbox_into_one_history_entry,
            cancel_drains_every_cancelled_inbox,
            notices_and_broadcasts_to_terminal_instances_store_nothing,
            emit_outbox_delivered_in_same_commit,
            emit_to_missing_target_rejects_item,
            claim_inbox_bounded_in_arrival_order,
            children_zero_inserted_runnable_at_once,
            children_one_child_releases_parent,
            children_many_release_on_last,
            children_failed_child_releases_slot,
            children_decremented_once_when_child_reruns,
            children_uniqueness_counts_only_new,
            join_quorum_of_three_of_five_wakes_the_parent_once_at_the_third_success,
            join_cancels_the_rest_before_the_deciding_childs_notice,
            join_cancels_the_rest_in_the_order_the_children_were_scheduled,
            join_left_running_children_never_count_again,
            join_quorum_out_of_reach_wakes_the_parent_at_the_failure,
            join_deadline_wakes_the_parent_once_with_what_finished,
            join_deadline_and_a_childs_timer_in_one_sweep_leave_the_child_cancelled,
            join_two_due_deadline_timers_of_one_parent_wake_it_once,
            join_a_deadline_leaves_a_child_an_earlier_deadline_of_the_sweep_cancelled,
            join_bad_policies_are_refused_naming_the_field,
            lease_expiry_reap_increments_attempt,
            reap_unexpired_lease_does_nothing,
            reap_owner_reclaims_its_rows,
            release_keeps_attempt,
            heartbeat_extends_and_refuses_stale,
            heartbeat_naming_a_lease_twice_is_refused_naming_the_field,
            uniqueness_in_and_out_of_scope,
            uniqueness_within_one_batch,
            uniqueness_reinsert_after_key_leaves_scope,
            uniqueness_commit_bringing_a_held_key_back_conflicts,
            uniqueness_reap_and_release_into_a_held_key_keep_the_holder,
            claim_passes_over_rows_whose_unique_key_a_running_row_holds,
            claim_order_priority_then_eligible_at,
            claim_skips_future_eligible_at,
            claim_filters_namespace_queue_machine,
            paused_queue_not_claimed_until_resumed,
            queue_list_lists_exactly_the_queues_with_settings,
            queue_resume_records_no_settings,
            concurrency_key_serializes,
            claim_never_returns_held_row,
            claim_order_fifo_ignores_priority,
            claim_order_starvation_bound_overtakes_priority,
            signal_priority_raises_the_claim_priority_until_consumed,
            global_limit_bounds_a_queues_executing_rows,
            key_limit_runs_k_rows_of_a_key_at_once,
            rate_limit_bounds_a_queues_starts,
            rate_limit_burst_of_one_keeps_its_rate,
            key_rate_limit_bounds_each_keys_starts,
            key_rate_limit_keeps_each_keys_rate,
            claim_fair_across_concurrency_keys,
            claim_fair_reaches_a_key_behind_more_full_keys_than_one_scan_visits,
            retry_exhaustion_dead_letter_then_retry,
            dead_letter_retry_by_machine,
            dead_letter_machine_operations_reach_past_a_full_batch,
            dead_letter_skip_consumes_signals,
            dead_letter_purge_older_than,
            a_purge_keeping_suspended_instances_leaves_the_letters_they_are_retried_by,
            cancel_cascade_releases_parent_barrier,
            cancel_rules_terminal_missing_executing,
            a_cancel_limited_to_runnable_leaves_a_claimed_instance_to_its_step,
            cancel_cascade_reaches_every_live_descendant_of_a_wide_tree,
            cancel_cascade_follows_a_deep_chain_to_the_depth_bound,
            cancel_cascade_frees_the_keys_of_a_mixed_tree,
            instance_get_and_lookup,
            a_lone_insert_stores_what_a_batch_stores,
            a_batch_insert_answers_in_batch_order,
            instance_rows_read_many_at_once,
            payload_over_limit_rejected,
            batch_over_limit_rejected,
            json_nested_too_deep_rejected_everywhere,
            nul_characters_rejected_everywhere,
            a_position_opening_with_a_bracket_must_be_a_chart_configuration,
            escaped_text_and_edge_numbers_read_back_unchanged,
            undecodable_marker_key_reserved,
            time_and_delay_bounds_enforced,
            await_with_step_moves_and_parks,
            spawned_children_report_to_the_parent_inbox,
            cancelled_child_reports_failure_to_the_parent,
            child_notice_unread_when_its_state_is_left_is_withdrawn,
            a_signal_sent_during_a_step_that_withdraws_fires_still_wakes,
            leaving_a_delegation_state_cancels_its_children,
            leaving_a_delegation_state_cancels_its_child_behind_many_kept_ones,
            a_retried_delegation_state_cancels_its_old_child_and_keeps_the_new,
            failing_instance_cancels_its_delegated_children,
            signals_reach_a_delegated_child,
            broadcast_reaches_instances_in_state,
            instance_list_filters_and_pages,
            timer_after_fires_once,
            timer_cancelled_when_state_left,
            timer_every_ticks_on_the_grid_of_its_state_entry,
            timer_every_max_then_once,
            timer_concurrent_sweeps_deliver_once,
            timer_cancel_and_arm_in_one_commit_renews,
            timer_fire_unread_when_its_state_is_left_is_withdrawn,
            timer_next_due_is_the_earliest_in_scope,
            timer_hint_follows_a_commit_that_arms,
            timers_dropped_with_terminal_instances,
            timer_status_and_queue_stats,
            timers_follow_a_deployed_duration,
            timer_every_is_held_while_its_instance_is_suspended,
            timer_every_is_held_while_its_queue_is_paused,
            migration_dry_run_reports_and_apply_moves_mapped_instances,
            prune_deletes_exactly_the_instances_ended_before_the_cutoff,
            prune_keeps_an_instance_its_dead_letters_name,
            a_business_key_resolves_to_its_newest_instance_left_after_a_prune,
            prune_refuses_a_page_size_out_of_bounds,
            history_page_walks_newest_first_to_the_oldest_entry,
            history_trim_keeps_the_newest_entries_in_batches,
            claim_by_ids_takes_only_the_named_ready_instances,
            instance_list_pages_newest_first_with_filters,
            dead_letter_list_pages_by_id_cursor,
            dead_letter_counts_per_machine,
            queue_stats_counts_every_unfinished_status,
            instance_activity_counts_ended_instances_per_bucket,
            worker_heartbeat_records_and_lists_live_workers,
            ready_stale_returns_instances_ready_for_the_bound,
            schedule_pause_is_stored_for_every_worker,
            schedule_states_are_bounded_per_namespace,
            schedule_fired_keeps_the_latest_tick_for_every_worker,
            schedule_fired_rows_share_the_bound_of_a_namespace,
            schedule_resume_re_anchors_a_fired_tick_ahead_of_it,
            schedule_forget_deletes_states_and_frees_their_place,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __store_contract_names {
    ([] $($name:ident),* $(,)?) => {
        /// The names of every store contract, in suite order. A tidy check compares the
        /// tests each backend generates against this list.
        pub const STORE_CONTRACTS: &[&str] = &[$(stringify!($name)),*];
    };
}

__store_contract_list!(__store_contract_names;);

#[doc(hidden)]
#[macro_export]
macro_rules! __store_conformance_expand {
    ([$ctor:expr, $var:expr] $($name:ident),* $(,)?) => {
        $(
            #[::tokio::test]
            async fn $name() {
                if let Some(store) = $crate::conformance::backend_or_skip(stringify!($name), $var, $ctor.await) {
                    $crate::conformance::$name(&store).await;
                }
            }
        )*
    };
}

/// Expands the whole store conformance suite into one named `#[tokio::test]` per contract.
///
/// `store_conformance_tests!(ctor)` or `store_conformance_tests!(ctor, "ENV_VAR")`, where
/// `ctor` is an expression evaluating to a future of `Option<S>` with `S: Store` (`None` =
/// backend not configured) and `ENV_VAR` names what to set to configure it.
///
/// ```text
/// keel_testkit::store_conformance_tests!(async { Some(keel_testkit::MemoryStore::new()) });
/// ```
#[macro_export]
macro_rules! store_conformance_tests {
    ($ctor:expr $(,)?) => {
        $crate::store_conformance_tests!($ctor, "the variable its constructor reads");
    };
    ($ctor:expr, $var:expr $(,)?) => {
        $crate::__store_contract_list!(__store_conformance_expand; $ctor, $var);
    };
}

/// What a generated test does with its constructor's result: the store, or `None` after
/// printing a loud skip line — or a panic naming `var` when [`REQUIRE_BACKENDS_VAR`] is
/// `1`.
pub fn backend_or_skip<S>(contract: &str, var: &str, store: Option<S>) -> Option<S> {
    let required = std::env::var(REQUIRE_BACKENDS_VAR).is_ok_and(|v| v == "1");
    backend_or_skip_with(contract, var, store, required)
}

/// [`backend_or_skip`] with the requirement passed in rather than read from the
/// environment.
pub fn backend_or_skip_with<S>(
    contract: &str,
    var: &str,
    store: Option<S>,
    required: bool,
) -> Option<S> {
    if store.is_some() {
        return store;
    }
    assert!(
        !required,
        "{contract}: backend not configured but {REQUIRE_BACKENDS_VAR}=1; set {var} to run it"
    );
    skip_notice(&format!(
        "SKIPPED: store contract {contract}: backend not configured (set {var} to run it)"
    ));
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_names_are_unique_and_enough() {
        let unique: std::collections::BTreeSet<_> = STORE_CONTRACTS.iter().collect();
        assert_eq!(unique.len(), STORE_CONTRACTS.len(), "duplicate contract name");
        assert!(STORE_CONTRACTS.len() >= 30, "the suite promises at least 30 contracts");
    }

    #[test]
    fn configured_backend_is_used_and_a_missing_one_skips() {
        assert_eq!(backend_or_skip_with("c", "V", Some(7), true), Some(7));
        assert_eq!(backend_or_skip_with::<()>("c", "V", None, false), None);
    }

    #[test]
    #[should_panic(expected = "set KEEL_TEST_DATABASE_URL to run it")]
    fn a_required_backend_that_is_missing_fails_and_names_the_variable() {
        backend_or_skip_with::<()>("c", "KEEL_TEST_DATABASE_URL", None, true);
    }
}
