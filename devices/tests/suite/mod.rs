//! The device test suite, written once and generic over the backend: every
//! device runs it — the cpu device in CI, the cuda and hip devices on their
//! GPUs (`device_cuda.rs`, `device_hip.rs`, `#[ignore]`d: `ci/gpu-check.sh`
//! runs them with `--include-ignored`). Expected values are computed on the host.
#![allow(dead_code)]

pub mod batch;
pub mod compute;
pub mod spaces;
pub mod stream;

/// Emits one `#[test]` per case of the suite, each making its devices with
/// `$make` (a `Fn() -> anyhow::Result<Device>`) and carrying the attributes
/// given first (`#[ignore = "needs a GPU"]` where the device is not always
/// there: the runner then reports the case as ignored, and a run with
/// `--ignored` without the device fails).
#[macro_export]
macro_rules! device_suite {
    ($(#[$attr:meta])* $backend:ty, $make:expr) => {
        $crate::device_suite!(@cases [$(#[$attr])*] $backend, $make;
        copy_of_whole_buffers_and_sub_views_for_every_dtype => stream::copy_of_whole_buffers_and_sub_views_for_every_dtype,
        copy_between_overlapping_ranges_of_one_buffer_reads_the_source_first => stream::copy_between_overlapping_ranges_of_one_buffer_reads_the_source_first,
        copy_from_host_captures_the_host_bytes_before_returning => stream::copy_from_host_captures_the_host_bytes_before_returning,
        copy_to_host_completes_when_the_copy_has_run_in_stream_order => stream::copy_to_host_completes_when_the_copy_has_run_in_stream_order,
        fill_sets_every_element_of_the_view_for_every_dtype => stream::fill_sets_every_element_of_the_view_for_every_dtype,
        fill_rounds_float_values_to_nearest_even => stream::fill_rounds_float_values_to_nearest_even,
        fill_with_a_value_out_of_the_dtype_range_is_refused_and_changes_nothing => stream::fill_with_a_value_out_of_the_dtype_range_is_refused_and_changes_nothing,
        cast_between_every_pair_of_float_dtypes_rounds_to_nearest_even => stream::cast_between_every_pair_of_float_dtypes_rounds_to_nearest_even,
        cast_of_a_sub_view_writes_only_that_range => stream::cast_of_a_sub_view_writes_only_that_range,
        cast_refuses_integer_dtypes_and_length_mismatches => stream::cast_refuses_integer_dtypes_and_length_mismatches,
        scale_multiplies_in_the_dtype_opmath_and_rounds_once => stream::scale_multiplies_in_the_dtype_opmath_and_rounds_once,
        accumulate_of_same_dtype_floats_rounds_the_sum_once => stream::accumulate_of_same_dtype_floats_rounds_the_sum_once,
        accumulate_of_integers_wraps_like_twos_complement => stream::accumulate_of_integers_wraps_like_twos_complement,
        accumulate_widens_f16_and_bf16_into_f32 => stream::accumulate_widens_f16_and_bf16_into_f32,
        accumulate_refuses_mixed_integer_dtypes_and_length_mismatches => stream::accumulate_refuses_mixed_integer_dtypes_and_length_mismatches,
        axpy_adds_a_scaled_vector_of_any_float_dtype => stream::axpy_adds_a_scaled_vector_of_any_float_dtype,
        views_out_of_range_are_errors => stream::views_out_of_range_are_errors,
        argument_errors_are_typed_and_enqueue_nothing => stream::argument_errors_are_typed_and_enqueue_nothing,
        views_events_and_buffers_of_another_device_are_refused => stream::views_events_and_buffers_of_another_device_are_refused,
        memory_statistics_are_exact => stream::memory_statistics_are_exact,
        copy_2d_batch_runs_every_copy_in_order_and_checks_all_first => batch::copy_2d_batch_runs_every_copy_in_order_and_checks_all_first,
        fill_batch_fills_every_view_and_checks_all_first => batch::fill_batch_fills_every_view_and_checks_all_first,
        copy_2d_batch_of_many_pieces_equals_the_copies_in_order => batch::copy_2d_batch_of_many_pieces_equals_the_copies_in_order,
        fill_batch_of_many_views_equals_the_fills_one_by_one => batch::fill_batch_of_many_views_equals_the_fills_one_by_one,
        a_host_function_on_a_failed_stream_runs_after_the_work_before_it => stream::a_host_function_on_a_failed_stream_runs_after_the_work_before_it,
        dropping_buffers_with_queued_work_frees_them_after_the_work => stream::dropping_buffers_with_queued_work_frees_them_after_the_work,
        host_buffers_start_zeroed_and_are_counted_apart => spaces::host_buffers_start_zeroed_and_are_counted_apart,
        copies_between_the_spaces_are_exact_and_in_stream_order => spaces::copies_between_the_spaces_are_exact_and_in_stream_order,
        copy_2d_between_the_spaces_moves_the_blocks => spaces::copy_2d_between_the_spaces_moves_the_blocks,
        kernels_on_host_buffers_work_or_are_refused_as_the_device_declares => spaces::kernels_on_host_buffers_work_or_are_refused_as_the_device_declares,
        dropping_a_host_buffer_with_queued_copies_frees_it_after_them => spaces::dropping_a_host_buffer_with_queued_copies_frees_it_after_them,
        update_on_host_runs_in_stream_order_on_host_bytes => spaces::update_on_host_runs_in_stream_order_on_host_bytes,
        matmul_matches_a_naive_product_for_every_transpose_and_dtype => compute::matmul_matches_a_naive_product_for_every_transpose_and_dtype,
        matmul_works_on_sub_views => compute::matmul_works_on_sub_views,
        matmul_refuses_bad_shapes_and_dtypes => compute::matmul_refuses_bad_shapes_and_dtypes,
        bias_add_adds_the_bias_to_every_row => compute::bias_add_adds_the_bias_to_every_row,
        relu_and_its_backward_for_every_float_dtype => compute::relu_and_its_backward_for_every_float_dtype,
        relu_propagates_nan_like_pytorch => compute::relu_propagates_nan_like_pytorch,
        mse_loss_and_gradient => compute::mse_loss_and_gradient,
        column_sums_over_rows_with_and_without_accumulation => compute::column_sums_over_rows_with_and_without_accumulation,
        sum_squares_with_and_without_accumulation => compute::sum_squares_with_and_without_accumulation,
        clip_scale_scales_only_above_the_max_norm => compute::clip_scale_scales_only_above_the_max_norm,
        sgd_step_matches_pytorch_with_and_without_momentum_nesterov_and_weight_decay => compute::sgd_step_matches_pytorch_with_and_without_momentum_nesterov_and_weight_decay,
        adamw_step_matches_pytorch_over_several_steps => compute::adamw_step_matches_pytorch_over_several_steps,
        );
    };
    (@cases $attrs:tt $backend:ty, $make:expr; $($name:ident => $module:ident :: $case:ident,)*) => {
        $(
            $crate::device_suite!(@case $attrs $backend, $make, $name, $module::$case);
        )*
    };
    (@case [$($attr:tt)*] $backend:ty, $make:expr, $name:ident, $module:ident :: $case:ident) => {
        #[test]
        $($attr)*
        fn $name() -> anyhow::Result<()> {
            suite::$module::$case::<$backend>(&$make)
        }
    };
}
