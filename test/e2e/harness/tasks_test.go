package harness

import (
	"maps"
	"testing"
)

func TestParseTaskPIDs(t *testing.T) {
	out := "TASK                                                                PID     STATUS    \n" +
		"5d0c7f0e8a1b2c3d4e5f60718293a4b5c6d7e8f90123456789abcdef01234567    4242    RUNNING\n" +
		"a1b2c3                                                              0       CREATED\n" +
		"ffee                                                                517     STOPPED\n" +
		"bad                                                                 x       RUNNING\n" +
		"cafe                                                                77      RUNNING\n"
	want := map[string]int{"5d0c7f0e8a1b2c3d4e5f60718293a4b5c6d7e8f90123456789abcdef01234567": 4242, "cafe": 77}
	if got := parseTaskPIDs(out); !maps.Equal(got, want) {
		t.Fatalf("parseTaskPIDs = %v, want %v", got, want)
	}
	if got := parseTaskPIDs(""); len(got) != 0 {
		t.Fatalf("parseTaskPIDs(\"\") = %v, want none", got)
	}
}
