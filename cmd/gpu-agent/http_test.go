package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestFewAtATime(t *testing.T) {
	entered := make(chan string, 3)
	release := make(chan struct{})
	h := fewAtATime(1, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- r.URL.Path
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	serve := func(ctx context.Context, path string) <-chan int {
		code := make(chan int, 1)
		go func() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequestWithContext(ctx, http.MethodGet, path, nil))
			code <- rec.Code
		}()
		return code
	}

	first := serve(context.Background(), "/first")
	if got := <-entered; got != "/first" {
		t.Fatalf("%s entered first", got)
	}
	// While /first renders, /second waits for its turn; its client has
	// already given up, so it never gets one.
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	if code := <-serve(gone, "/second"); code != http.StatusServiceUnavailable {
		t.Errorf("a request whose client gave up while another rendered: %d, want 503", code)
	}
	third := serve(context.Background(), "/third")
	release <- struct{}{}
	if code := <-first; code != http.StatusOK {
		t.Errorf("/first: %d", code)
	}
	if got := <-entered; got != "/third" {
		t.Fatalf("%s entered after /first, want /third", got)
	}
	release <- struct{}{}
	if code := <-third; code != http.StatusOK {
		t.Errorf("/third: %d", code)
	}
}
