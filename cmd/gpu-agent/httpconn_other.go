//go:build !linux

package main

import (
	"net"
	"syscall"
	"time"
)

// deferAccept has no portable equivalent: a connection is accepted as soon
// as it is made.
func deferAccept(syscall.RawConn, time.Duration) error { return nil }

// peek cannot peek portably: every connection bound for the reserve then
// goes to the guard.
func peek(net.Conn, []byte) int { return 0 }

// hasUnread cannot peek portably and says there is nothing unread: whether
// a connection waits on its client is then judged by its reader alone.
func hasUnread(net.Conn) bool { return false }
