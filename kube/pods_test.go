package kube

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/gpu-agent/gpu-agent/internal/testwait"
	"github.com/gpu-agent/gpu-agent/usage"
)

func gpuPod(name, uid, ctr string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: name, UID: types.UID("0000000" + uid + "-0000-4000-8000-000000000000"),
			Labels: map[string]string{"big": strings.Repeat("x", 60)}},
		Spec: corev1.PodSpec{NodeName: "node-1", Containers: []corev1.Container{{Name: "main", Image: "cuda"}}},
		Status: corev1.PodStatus{ContainerStatuses: []corev1.ContainerStatus{{Name: "main", Image: "cuda",
			ContainerID: "containerd://" + strings.Repeat(ctr, 64)}}},
	}
}

// TestPodWatcher: the index names a process's pod and container from its
// cgroup's UID and container ID, follows pods that come, and keeps nothing
// else of a Pod.
func TestPodWatcher(t *testing.T) {
	client := fake.NewClientset(gpuPod("a", "1", "a"))
	w := NewPodWatcher(client, "node-1", nil)
	if w.PodIndex() != nil {
		t.Fatal("an index before the watch listed the pods")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = w.Run(ctx) }()
	owner := func(uid, ctr string) usage.Owner {
		return usage.Owner{PodUID: "0000000" + uid + "-0000-4000-8000-000000000000", ContainerID: strings.Repeat(ctr, 64)}
	}
	testwait.For(t, "pod a indexed", func() bool { _, ok := w.PodIndex().Lookup(owner("1", "a")); return ok })
	if got, _ := w.PodIndex().Lookup(owner("1", "a")); got.Pod != "a" || got.Container != "main" || got.Namespace != "ml" {
		t.Errorf("pod a: %+v", got)
	}
	if _, err := client.CoreV1().Pods("ml").Create(ctx, gpuPod("b", "2", "b"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "pod b indexed", func() bool { _, ok := w.PodIndex().Lookup(owner("2", "b")); return ok })
	ref, ok := w.Ref("ml", "b")
	if !ok || ref.Kind != "Pod" || ref.UID != "00000002-0000-4000-8000-000000000000" {
		t.Errorf("Ref: %+v, %v", ref, ok)
	}
	for _, p := range w.pods() {
		if len(p.Labels) != 0 || len(p.Spec.Containers) != 0 || p.Status.ContainerStatuses[0].Image != "" {
			t.Errorf("pod %s kept more than it needs: %+v", p.Name, p)
		}
	}
}

// TestPodWatcherOnPodEnded: a pod's deletion and its move to a terminal
// phase are told (the agent then lists pod-resources again); a pod that
// changes otherwise, or is already ended, is not.
func TestPodWatcherOnPodEnded(t *testing.T) {
	done := gpuPod("done", "3", "c")
	done.Status.Phase = corev1.PodSucceeded
	client := fake.NewClientset(gpuPod("a", "1", "a"), gpuPod("b", "2", "b"), done)
	w := NewPodWatcher(client, "node-1", nil)
	var ended atomic.Int32
	w.OnPodEnded(func() { ended.Add(1) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = w.Run(ctx) }()
	testwait.For(t, "pods indexed", func() bool { return w.PodIndex() != nil })
	steps := []struct {
		name  string
		do    func() error
		ended int32
	}{
		{"a relabelled", func() error {
			p := gpuPod("a", "1", "a")
			p.Labels = map[string]string{"x": "y"}
			p.Status.Phase = corev1.PodRunning
			_, err := client.CoreV1().Pods("ml").Update(ctx, p, metav1.UpdateOptions{})
			return err
		}, 0},
		{"a succeeded", func() error {
			p := gpuPod("a", "1", "a")
			p.Status.Phase = corev1.PodSucceeded
			_, err := client.CoreV1().Pods("ml").UpdateStatus(ctx, p, metav1.UpdateOptions{})
			return err
		}, 1},
		{"b deleted", func() error { return client.CoreV1().Pods("ml").Delete(ctx, "b", metav1.DeleteOptions{}) }, 2},
	}
	for _, st := range steps {
		gen := w.changed.Load()
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		testwait.For(t, st.name+" seen", func() bool { return w.changed.Load() > gen })
		if got := ended.Load(); got != st.ended {
			t.Errorf("after %s: told of %d ended pods, want %d", st.name, got, st.ended)
		}
	}
}
