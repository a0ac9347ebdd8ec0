-- Dead letters by the instance they hold: a prune page asks of every row it reads whether
-- a letter still holds it, and deleting an instance checks the letters' foreign key. Without
-- this index both read the whole dead-letter table, inside the one write transaction.
CREATE INDEX keel_dead_letters_instance ON keel_dead_letters (instance_id);
