-- Keel schema, version 13: the uniqueness guard keeps its holder. The guard was a
-- generated column (the key while the status is in the row's scope), so a row the store
-- itself moved back into scope (a reaped or given-back lease, a delivery or timer that
-- wakes it) while another row held its key broke the unique index; one such row failed
-- every reap that included it, and no expired lease came back. The guard is now written
-- by a trigger: on insert as before (a second holder is refused, as inserts report
-- duplicates), and on update the key only when no other row holds it, so the row that
-- holds the key keeps it and the returning row runs without it, as the other stores do.
-- A claim that brings a key scoped to executing (and not runnable) into scope still
-- takes it or fails on the index: two claims racing for such keys must not both run
-- (the losing claim runs again and skips the row).
ALTER TABLE instances ALTER COLUMN unique_guard DROP EXPRESSION;

CREATE FUNCTION instances_unique_guard() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
  guard bytea := CASE WHEN NEW.unique_key IS NOT NULL AND NEW.status = ANY (NEW.unique_scope)
                      THEN NEW.unique_key END;
BEGIN
  IF TG_OP = 'UPDATE' AND guard IS NOT NULL AND OLD.unique_guard IS DISTINCT FROM guard
     AND NOT (OLD.status = 'runnable' AND NEW.status = 'executing'
              AND NOT 'runnable' = ANY (NEW.unique_scope))
     AND EXISTS (SELECT 1 FROM instances o WHERE o.unique_guard = guard AND o.id <> NEW.id) THEN
    guard := NULL;
  END IF;
  NEW.unique_guard := guard;
  RETURN NEW;
END
$$;

CREATE TRIGGER instances_unique_guard_insert BEFORE INSERT ON instances
  FOR EACH ROW WHEN (NEW.unique_key IS NOT NULL)
  EXECUTE FUNCTION instances_unique_guard();

CREATE TRIGGER instances_unique_guard_update
  BEFORE UPDATE OF status, unique_key, unique_scope ON instances
  FOR EACH ROW WHEN (NEW.unique_key IS NOT NULL OR OLD.unique_guard IS NOT NULL)
  EXECUTE FUNCTION instances_unique_guard();
