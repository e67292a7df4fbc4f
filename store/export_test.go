package store

// CreationsWaiting is how many batch creations wait for their turn, over
// every account-day.
func (s *Store) CreationsWaiting() int {
	s.groups.mu.Lock()
	defer s.groups.mu.Unlock()
	n := 0
	for _, q := range s.groups.queues {
		n += len(q.waiting)
	}
	return n
}
