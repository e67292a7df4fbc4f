// Package sockopt reads the options of a connection's socket, for tests that
// check what a dialer set.
package sockopt
